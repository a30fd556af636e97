"""LoRA GRPO side by side: spinwheel (``--lora-rank``) vs TRL's ``GRPOTrainer`` with a ``peft`` ``LoraConfig``, on the
same checkpoint, prompts, reward, seed and settings: step time and peak memory, ratios printed.

    python benchmarks/lora_vs_trl.py --model runs/demo/sft/checkpoint [--steps 40] [--rank 8] [--lr 1e-3]

The set-up is ``benchmarks/grpo_vs_trl.py``'s (its docstring lists the matched settings: G, prompts per step, one
optimizer step per rollout, lr constant, AdamW β₂ 0.95, clip 1.0, β with the k3 estimator, ε, temperature 1,
fp32, token-mean loss / TRL's "dapo", group-scaled rewards, the same prompts in the same order), plus the same
adapters on both sides: rank ``--rank``, alpha ``--alpha`` (default 2 r), no dropout, on every projection (q k v o
gate up down; PEFT's ``target_modules`` of those names), the base frozen. With β > 0 (default 0.04) both take the
reference log-probs from the policy with its adapters switched off (TRL: ``disable_adapter``, spinwheel:
``adapters_disabled``): neither loads a second model.

* **Step time**: the two trainers in one process taking turns one step at a time (grpo_vs_trl's baton), so the
  machine's load hits both alike; median wall and CPU time per step, the first step left out.
* **Peak memory**: each system alone in a child process (peak RSS is per process) for ``--memory-steps`` steps:
  ``ru_maxrss`` and the part of it above the resident set once the imports are done and before anything is loaded
  (the imports themselves: torch, transformers, TRL, differ between the two and are not the training's memory).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_vs_trl as gvt  # noqa: E402 — the shared set-up (a script in this folder, not a package)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def use_lora(args: argparse.Namespace) -> None:
    """Give both of grpo_vs_trl's runs the adapters: spinwheel's RLConfig the ``--lora-*`` options, TRL's trainer a
    ``peft_config`` (both are looked up when a run starts, so rebinding them here is enough)."""
    import trl
    from peft import LoraConfig

    import spinwheel.rl.llm as rl

    gvt.RLConfig = functools.partial(
        rl.RLConfig, lora_rank=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, lora_targets=",".join(TARGETS)
    )
    peft_config = LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM"
    )
    trl.GRPOTrainer = functools.partial(trl.GRPOTrainer, peft_config=peft_config)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_child(args: argparse.Namespace, system: str) -> None:
    """One system alone (this process is the child): its run, then its figures as one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    use_lora(args)
    baseline = rss_mb()
    with tempfile.TemporaryDirectory(prefix="lora_vs_trl-") as tmp:
        work = Path(tmp)
        ckpt = gvt.prepare_checkpoint(args, work)
        baton = gvt.Baton()
        baton.hand_on(gvt.SYSTEMS[1 - gvt.SYSTEMS.index(system)], leave=True)  # the other system never runs
        run = gvt.Run(system, baton)
        trained = {}
        if system == "trl":
            trainer = gvt.run_trl(args, ckpt, work, run)
            model = trainer.model
            trained = {
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "optimizer_mb": optimizer_mb(trainer.optimizer),
            }
        else:
            jobs = []
            init = gvt.run_harness.Run.train

            def keep(self, job, *a, **k):  # the job, for its optimizer state
                jobs.append(job)
                return init(self, job, *a, **k)

            gvt.run_harness.Run.train = keep
            gvt.run_spinwheel(args, ckpt, work, run)
            model = jobs[-1].learner.model
            trained = {
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "optimizer_mb": optimizer_mb(jobs[-1].learner.optimizer),
            }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"system": system, "peak_mb": peak, "baseline_mb": baseline, **trained}))


def optimizer_mb(optimizer) -> float:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps TRL's
    tensors = [t for s in inner.state.values() for t in s.values() if hasattr(t, "numel")]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def measure_memory(args: argparse.Namespace) -> dict[str, dict]:
    out = {}
    for system in gvt.SYSTEMS:
        cmd = [sys.executable, __file__, "--memory-child", system, *sys.argv[1:]]
        cmd = [c for c in cmd if c != "--no-memory"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            raise SystemExit(f"the {system} memory run failed:\n{proc.stderr[-3000:]}")
        out[system] = json.loads(lines[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/demo/sft/checkpoint", help="spinwheel HF checkpoint dir or preset")
    parser.add_argument("--steps", type=int, default=40, help="steps of the timed run (both systems in turns)")
    parser.add_argument("--memory-steps", type=int, default=10, help="steps of each system's memory run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--last", type=int, default=10, help="steps the final mean reward is taken over")
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--eval-samples", type=int, default=4, help="sampled completions per held-out prompt")
    parser.add_argument("--no-memory", action="store_true", help="skip the two memory runs")
    parser.add_argument("--memory-child", choices=gvt.SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.alpha = args.alpha if args.alpha is not None else 2.0 * args.rank
    args.engine_cpu_packed_weights, args.work_dir = False, None  # grpo_vs_trl's defaults
    if args.memory_child:
        args.steps = args.memory_steps
        return memory_child(args, args.memory_child)
    import torch

    torch.set_num_threads(args.threads)
    memory = {} if args.no_memory else measure_memory(args)
    use_lora(args)
    print(
        f"LoRA GRPO, {args.model}: r {args.rank}, alpha {args.alpha:g}, targets {','.join(TARGETS)}; {args.steps} "
        f"steps × {args.prompts} prompts × G {args.group_size}, ≤ {args.max_new_tokens} new tokens, lr {args.lr}, "
        f"β {args.beta}, threads {args.threads}, torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="lora_vs_trl-") as tmp:
        work = Path(tmp)
        runs = gvt.run_both(args, gvt.prepare_checkpoint(args, work), work)
    med = {n: (statistics.median(r.step_times), statistics.median(r.cpu_times)) for n, r in runs.items()}
    for name, run in runs.items():
        print(
            f"  {name:>9}: {1e3 * med[name][0]:.1f} ms/step median (CPU {1e3 * med[name][1]:.1f} ms); sampled reward "
            f"first {args.last} steps {statistics.fmean(run.rewards[: args.last]):.3f} → last {args.last} "
            f"{statistics.fmean(run.rewards[-args.last :]):.3f}; held-out greedy exact match after "
            f"{run.eval_after:.3f}"
        )
        if name in memory:
            m = memory[name]
            print(
                f"  {name:>9}: peak RSS {m['peak_mb']:.0f} MiB ({m['peak_mb'] - m['baseline_mb']:.0f} above the "
                f"imports), {m['trainable']:,} trainable parameters, optimizer state {m['optimizer_mb']:.3f} MiB"
            )
    for run in runs.values():
        gvt.print_phases(run)
    (s_wall, s_cpu), (t_wall, t_cpu) = med["spinwheel"], med["trl"]
    ratios = f"spinwheel / TRL: step time {s_wall / t_wall:.3f} (CPU {s_cpu / t_cpu:.3f})"
    if memory:
        s, t = memory["spinwheel"], memory["trl"]
        ratios += (
            f", peak RSS {s['peak_mb'] / t['peak_mb']:.3f}, above the imports "
            f"{(s['peak_mb'] - s['baseline_mb']) / (t['peak_mb'] - t['baseline_mb']):.3f}"
        )
    print(ratios)


if __name__ == "__main__":
    main()
