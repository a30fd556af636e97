"""Memory of LoRA vs full fine-tuning in GRPO with a KL penalty (β > 0, so a reference policy is needed): peak RSS,
optimizer-state bytes and what one update's weight sync moves (issue 25's acceptance figures).

    python benchmarks/lora_memory.py [--model small] [--steps 3] [--rank 8] [--targets q,k,v,o,gate,up,down]

Each mode runs in its own process (peak RSS is per process): a short GRPO run on the built-in task, then
``resource.getrusage``'s ``ru_maxrss`` (and the part of it above the resident set before the run, the imports'),
the bytes of every tensor in the policy's AdamW state, and the step-0 record's ``full_sync_mb`` /
``lora_sync_mb``. Full fine-tuning loads a second copy of the model as its reference; LoRA switches its adapters
off instead, and its optimizer holds state for the adapters alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def current_rss_mb() -> float:
    """This process's resident set now (Linux: /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(args: argparse.Namespace, lora: bool) -> dict:
    """One run in this process; its figures."""
    from spinwheel.rl.llm import loop
    from spinwheel.rl.llm.config import RLConfig
    from spinwheel.train.metrics import read_metrics

    jobs: list = []
    init = loop.RLJob.__init__
    baseline_mb = current_rss_mb()  # the interpreter, torch and spinwheel imported, nothing loaded

    def keep(self, *a, **kw):
        init(self, *a, **kw)
        jobs.append(self)

    loop.RLJob.__init__ = keep  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as out:
        lora_options = dict(lora_rank=args.rank, lora_alpha=2 * args.rank, lora_targets=args.targets) if lora else {}
        config = RLConfig(
            model=args.model, out_dir=out, steps=args.steps, prompts_per_step=8, group_size=8, max_new_tokens=8,
            beta=0.04, lr=1e-4, eval_every=0, eval_examples=8, save_every=0, progress=False,
            num_threads=args.threads, **lora_options,
        )  # fmt: skip
        loop.train_rl(config)
        first = read_metrics(Path(out) / "metrics.jsonl")[0]
    optimizer = jobs[-1].learner.optimizer
    state_bytes = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if hasattr(t, "numel")
    )
    return {
        "mode": f"LoRA r={args.rank}" if lora else "full",
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "baseline_rss_mb": baseline_mb,
        "optimizer_state_mb": state_bytes / 2**20,
        "trainable_params": first["num_trainable_params"],
        "sync_mb": first["lora_sync_mb"] if lora else first["full_sync_mb"],
        "full_sync_mb": first["full_sync_mb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", choices=["full", "lora"], help=argparse.SUPPRESS)  # a child process's mode
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.one == "lora")))
        return
    rows = []
    for mode in ("full", "lora"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", mode], capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        "| mode | trainable params | peak RSS (MiB) | of which the run | optimizer state (MiB) "
        "| sync per update (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['trainable_params']:,} | {r['peak_rss_mb']:.0f} | "
            f"{r['peak_rss_mb'] - r['baseline_rss_mb']:.0f} | {r['optimizer_state_mb']:.2f} | {r['sync_mb']:.2f} |"
        )
    full, lora = rows
    print(
        f"optimizer state: {100 * lora['optimizer_state_mb'] / full['optimizer_state_mb']:.2f}% of full; "
        f"sync: {100 * lora['sync_mb'] / full['sync_mb']:.2f}% of full; "
        f"peak RSS: {full['peak_rss_mb'] - lora['peak_rss_mb']:.0f} MiB less"
    )


if __name__ == "__main__":
    main()
