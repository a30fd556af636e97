"""LoRA under the parallel layouts: per-rank optimizer-state and gradient bytes, collective bytes per step and step
time, against full fine-tuning on the same layouts (issue 25's parallel part).

    python benchmarks/lora_parallel.py [--model small] [--rank 8] [--steps 12] [--batch 8] [--seq 64]

Each layout trains ``--steps`` SFT-style steps (token-mean NLL, AdamW, clipping at 1.0) of a global batch of
``--batch`` random rows on the learner the commands use: ``LocalLearner`` in one process (1 thread, then 2 threads:
the two cores a 2-rank run gets), ``ParallelLearner`` on 2 spawned gloo ranks (1 thread each) for dp 2 (DDP),
ZeRO-1, ZeRO-2 and tp 2. Figures per rank 0: optimizer state and gradient bytes from the tensors themselves
(:func:`~spinwheel.parallel.data.zero.memory_breakdown`), collective bytes of one step (the trainer's counters; an
all-reduce of Ψ bytes counts 2Ψ) and the median step time after two warm-up steps. The machine is shared: the load
average is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from spinwheel.models.lora import LoRAConfig, apply_lora
from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.parallel.comm import metrics_since
from spinwheel.parallel.data.zero import memory_breakdown
from spinwheel.parallel.trainer import nll_loss
from spinwheel.train.learners import LocalLearner, OptimConfig, ParallelLearner

LAYOUTS = {"dp2": dict(dp=2), "zero1": dict(zero=1), "zero2": dict(zero=2), "tp2": dict(tp=2)}


def make_model(args: argparse.Namespace, lora: bool) -> Transformer:
    model = Transformer(preset_config(args.model, args.vocab)).init_weights(seed=0)
    if lora:
        apply_lora(model, LoRAConfig(rank=args.rank, alpha=2.0 * args.rank), seed=0)
    return model


def batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        weights = torch.full((args.batch, args.seq), 1.0 / (args.batch * args.seq))
        out.append({"input_ids": ids, "labels": ids.roll(-1, dims=1), "weights": weights})
    return out


def timed(learner, args: argparse.Namespace) -> tuple[float, dict[str, int]]:
    """Median step seconds after two warm-up steps, and one step's collective bytes."""
    times, comm = [], {}
    for i, batch in enumerate(batches(args)):
        before = learner.comm_metrics()
        start = time.perf_counter()
        learner.train_step(batch, nll_loss, 1e-4)
        times.append(time.perf_counter() - start)
        if i == 2:
            comm = metrics_since(learner.comm_metrics(), before)
    return statistics.median(times[2:]), comm


def figures(learner, module, optimizer, seconds: float, comm: dict[str, int]) -> dict:
    mem = memory_breakdown(module, optimizer)
    step_bytes = sum(v for k, v in comm.items() if k.endswith("/bytes"))
    return {"optimizer": mem["optimizer"], "grads": mem["grads"], "comm": step_bytes, "seconds": seconds}


def one_process(args: argparse.Namespace, lora: bool, threads: int) -> dict:
    torch.set_num_threads(threads)
    model = make_model(args, lora)
    learner = LocalLearner(model, OptimConfig(1e-4, 0.0, 1.0))
    seconds, comm = timed(learner, args)
    return figures(learner, model, learner.optimizer, seconds, comm)


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    out = {}
    for lora in (True, False):
        for name, layout in LAYOUTS.items():
            learner = ParallelLearner(make_model(args, lora), OptimConfig(1e-4, 0.0, 1.0), ParallelConfig(**layout))
            seconds, comm = timed(learner, args)
            trainer = learner.trainer
            out["lora" if lora else "full", name] = figures(
                learner, trainer.pm.module, trainer.optimizer, seconds, comm
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--vocab", type=int, default=100)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    rows = {}
    for lora in (True, False):
        kind = "lora" if lora else "full"
        for threads in (1, 2):
            rows[kind, f"1 process, {threads} thread{'s' * (threads > 1)}"] = one_process(args, lora, threads)
    os.environ["OMP_NUM_THREADS"] = "1"
    rows.update(spawn(_rank, 2, args=(args,), timeout_s=1200)[0])
    load = os.getloadavg()
    print(f"{args.model} preset, LoRA r={args.rank} on every projection vs full; load average {load[0]:.1f}")
    print("| training | layout | optimizer state / rank (KiB) | gradients / rank (KiB) | collectives / step (KiB) "
          "| step (ms) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for (kind, name), r in rows.items():
        print(
            f"| {kind} | {name} | {r['optimizer'] / 1024:,.0f} | {r['grads'] / 1024:,.0f} | {r['comm'] / 1024:,.0f} "
            f"| {1000 * r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
