"""The loop DPO and reward-model training share: the step's pairs (a pure function of the seed and the step, as
SFT's batches are, so resuming needs no sampler state) → the trainer batch → one optimizer step of the pair loss
→ log, evaluate, save atomic checkpoints. Also the learners it runs on and a chunked forward over many pairs.

Batches hold ``2·batch_size`` interleaved rows (see :mod:`.preference_data`); every data-parallel shard and
micro-batch must hold whole pairs, so ``batch_size`` must be divisible by dp × microbatches.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from spinwheel.models.transformer import Transformer
from spinwheel.parallel.comm import metrics_since
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.parallel.trainer import Batch, LossFn
from spinwheel.rl.llm.pref_config import PreferenceConfig
from spinwheel.rl.llm.preference_data import PreferencePair
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.learners import Learner, LocalLearner, OptimConfig, ParallelLearner, is_main_process
from spinwheel.train.metrics import MetricsLogger
from spinwheel.train.optim import lr_at
from spinwheel.train.resume import OBSERVATION_OPTIONS, resume_message, resume_point
from spinwheel.train.sft_data import batch_indices

BuildBatch = Callable[[Sequence[PreferencePair]], Batch]  # pairs -> trainer batch of 2·len(pairs) rows
Evaluate = Callable[[int], dict[str, Any] | None]  # step -> held-out figures (logged by the callee)


def make_learner(
    model: Transformer,
    config: PreferenceConfig,
    dims: ParallelDims | None,
    *,
    frozen: bool = False,
    engine_copy: str = "main",
) -> Learner:
    """The single-process reference without ``dims``, else the parallel trainer (one learner per rank);
    ``frozen``: no optimizer (a reference model, forward only)."""
    optim = None if frozen else OptimConfig(config.lr, config.weight_decay, config.grad_clip)
    if dims is None:
        return LocalLearner(model, optim)
    return ParallelLearner(model, optim, config.parallel, dims, engine_copy="none" if frozen else engine_copy)


def check_layout(config: PreferenceConfig, distributed: bool) -> ParallelDims | None:
    """The layout's dims under torchrun (None in one process), with the pair-batch divisibility checked."""
    dims = config.parallel.make_dims()  # a readable error for e.g. --tp 2 without torchrun
    config.parallel.check_batch(config.batch_size, dims.dp, what="--batch-size (pairs)")
    return dims if distributed else None


@dataclass
class RunDirs:
    out_dir: Path
    ckpt_dir: Path
    state: dict[str, Any] | None  # trainer_state.pt of the checkpoint being resumed, if any

    @classmethod
    def open(cls, config: PreferenceConfig) -> RunDirs:
        """The run's directories and the checkpoint to resume, if any: refused (ValueError naming the options) when
        it was trained with settings that change the run's course, unless ``--force``, or when it is past
        ``--steps``; a resumed run says where it continues and what changed."""
        out_dir = Path(config.out_dir)
        ckpt_dir = out_dir / "checkpoint"
        state = load_trainer_state(ckpt_dir) if config.resume and ckpt_dir.is_dir() else None
        if state is not None:
            start_step, changes = resume_point(config, state, ckpt_dir, OBSERVATION_OPTIONS)
            if is_main_process():
                print(resume_message(start_step, config.steps, ckpt_dir, changes), flush=True)
        return cls(out_dir, ckpt_dir, state)

    @property
    def start_step(self) -> int:
        return int(self.state["step"]) if self.state is not None else 0


def forward_rows(
    learner: Learner,
    pairs: Sequence[PreferencePair],
    build: BuildBatch,
    reduce: Callable[[dict[str, torch.Tensor], Batch], torch.Tensor],
    chunk: int,
) -> torch.Tensor:
    """``reduce(outputs, batch)`` -> (2p,) per-row figures of a forward over ``pairs`` in chunks of ``chunk`` pairs,
    concatenated (2P,). The last chunk is topped up with copies of its last pair so every forward has the same
    number of rows (what the layout divides); their rows are dropped. Collective under torchrun."""
    out = []
    for start in range(0, len(pairs), chunk):
        part = list(pairs[start : start + chunk])
        batch = build(part + [part[-1]] * (chunk - len(part)))
        out.append(reduce(learner.forward(batch), batch)[: 2 * len(part)].cpu())
    return torch.cat(out) if out else torch.zeros(0)


def train_loop(
    config: PreferenceConfig,
    learner: Learner,
    pairs: Sequence[PreferencePair],
    build: BuildBatch,
    loss_fn: LossFn,
    *,
    start_step: int,
    log: Callable[[dict[str, Any]], None],
    evaluate: Evaluate,
    save: Callable[[int], None],
    desc: str,
) -> tuple[list[dict[str, Any]], int]:
    """Steps ``start_step`` .. the end of this run (``steps`` or ``stop_after``); returns (per-step records, the
    last step). Saves at ``save_every`` and at the end; on Ctrl-C in one process saves where it stopped."""
    end_step = config.steps if config.stop_after is None else min(config.steps, start_step + config.stop_after)
    history: list[dict[str, Any]] = []
    bar = tqdm(
        range(start_step, end_step),
        total=config.steps,
        initial=start_step,
        desc=desc,
        disable=not (config.progress and learner.is_main),
        dynamic_ncols=True,
        mininterval=1.0 if sys.stderr.isatty() else 10.0,
    )  # logs (not a terminal) get a line per 10 s
    t0 = time.perf_counter()
    try:
        for step in bar:
            batch = build([pairs[i] for i in batch_indices(step, config.batch_size, len(pairs), config.seed)])
            lr = lr_at(step, config.lr, config.warmup_steps, config.steps, config.min_lr_ratio)
            comm_before = learner.comm_metrics()
            out = learner.train_step(batch, loss_fn, lr)
            record = {
                "step": step + 1,
                **out.stats,
                "loss": out.loss,
                "lr": lr,
                "grad_norm": out.grad_norm,
                "pairs_per_s": (len(history) + 1) * config.batch_size / (time.perf_counter() - t0),
                **metrics_since(learner.comm_metrics(), comm_before),  # the step's collectives (torchrun)
            }
            log(record)
            history.append(record)
            bar.set_postfix(loss=f"{out.loss:.4f}", acc=f"{out.stats.get('accuracy', 0.0):.2f}", refresh=False)
            done = step + 1
            if config.eval_every and done % config.eval_every == 0 and done < config.steps:
                if (ev := evaluate(done)) is not None:
                    bar.write(
                        f"step {done}: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items() if isinstance(v, float))
                    )
            if config.save_every and done % config.save_every == 0 and done < end_step:
                save(done)
    except KeyboardInterrupt:
        bar.close()
        if learner.distributed:  # peers may be mid-collective: keep the last periodic checkpoint
            raise
        save(start_step + len(history))
        print(f"interrupted: checkpoint saved at step {start_step + len(history)}; rerun the same command to resume")
        raise
    bar.close()
    save(end_step)
    return history, end_step


def open_logger(learner: Learner, dirs: RunDirs) -> Callable[[dict[str, Any]], None]:
    """``log(record)``: appends to metrics.jsonl on the main rank (resumed runs drop records after the step)."""
    logger = (
        MetricsLogger(dirs.out_dir, resume_step=dirs.start_step if dirs.state is not None else None)
        if learner.is_main
        else None
    )
    return logger.log if logger is not None else (lambda record: None)
