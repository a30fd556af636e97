"""Learners: what a training loop steps. One protocol, two implementations side by side:

* :class:`LocalLearner` — the model and its AdamW in this process, the loss's per-token outputs from
  :func:`~spinwheel.train.local_outputs.local_outputs`: the reference every parallel layout is compared against;
* :class:`ParallelLearner` — the same on :class:`~spinwheel.parallel.trainer.ParallelTrainer` (any layout, one
  learner per rank) when ``torchrun`` started more than one process.

Both take a batch of the global rows (``input_ids``/``labels`` aligned, per-token tensors; see the trainer's
docstring) and a pluggable per-token loss, and return the global loss and stats. A learner built with
``optim=None`` is frozen (a reference model): forward only. ``engine_model`` is the full model an inference engine
generates with: the training weights themselves where this rank holds them whole (one process; DDP or ZeRO-1/2
without TP/PP), else a full copy that :meth:`ParallelLearner.sync_engine_model` gathers the weights into.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.config import ParallelConfig
from spinwheel.parallel.io.lazy_load import materialised_copy
from spinwheel.parallel.launch import destroy_distributed, init_distributed, launched_world_size
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.parallel.token_outputs import is_scalar_head
from spinwheel.parallel.trainer import Batch, LossFn, ParallelTrainer, StepResult
from spinwheel.train.checkpoint import rng_state, save_checkpoint, set_rng_state
from spinwheel.train.local_outputs import Layout, choose_layout, local_outputs, micro_batch_plan
from spinwheel.train.optim import ADAMW_BETAS, ADAMW_EPS, adamw_kernel, build_adamw, decays, set_lr
from spinwheel.train.packing import auto_micro_batch_tokens, rows_of
from spinwheel.train.parallel_checkpoint import SHARDED_DIR, save_parallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with decoupled weight decay on weight matrices, clipped by the global gradient norm."""

    lr: float
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0: measure the norm without clipping
    # torch's one-kernel AdamW where it exists (see optim.adamw_kernel); off by default: equal up to rounding, but
    # the demo's 300-step SFT at lr 3e-3 is so sensitive to rounding that fused moved it from 75.6% to 18%
    fused: bool = False


class Learner(Protocol):
    is_main: bool  # logs, evaluates and writes the checkpoint's HF files
    distributed: bool
    engine_model: Transformer | None  # the full model generation reads (None where nothing generates)

    def train_step(self, batch: Batch, loss_fn: LossFn, lr: float, *, entropy: bool = False) -> StepResult: ...
    def forward(self, batch: Batch, *, entropy: bool = False) -> dict[str, torch.Tensor]: ...
    def sync_engine_model(self) -> None: ...
    def comm_metrics(self) -> dict[str, int]: ...
    def load(self, ckpt_dir: Path, state: dict[str, Any] | None) -> None: ...
    def params_finite(self) -> bool: ...
    def save(self, ckpt_dir: Path, tokenizer: Tokenizer | None, state: dict[str, Any]) -> None: ...


class LocalLearner:
    """Single-process training of ``model`` (see the module docstring). ``micro_batch_tokens``: each forward (and
    backward) runs on consecutive rows of at most that many tokens in all (:mod:`~spinwheel.train.packing`; None:
    :func:`~spinwheel.train.packing.auto_micro_batch_tokens`, 0: the whole batch at once); the losses'
    contributions sum to the same global loss and gradients."""

    is_main = True
    distributed = False

    def __init__(
        self,
        model: Transformer,
        optim: OptimConfig | None,
        temperature: float = 1.0,
        micro_batch_tokens: int | None = 0,
    ) -> None:
        self.model, self.optim, self.temperature = model, optim, temperature
        auto = micro_batch_tokens is None and not is_scalar_head(model.config)
        self.micro_batch_tokens = auto_micro_batch_tokens(model.config) if auto else micro_batch_tokens or 0
        self.optimizer = (
            build_adamw(model, optim.lr, optim.weight_decay, fused=optim.fused) if optim is not None else None
        )
        self.engine_model = model  # generation reads the training weights themselves

    def train_step(self, batch: Batch, loss_fn: LossFn, lr: float, *, entropy: bool = False) -> StepResult:
        assert self.optimizer is not None and self.optim is not None, "a frozen learner cannot train"
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        total, sums = 0.0, {}
        layout, mbs = self.microbatches(batch)
        for mb in mbs:  # each micro-batch's graph is freed by its backward
            loss, stats = loss_fn(local_outputs(self.model, mb, entropy, self.temperature, layout), mb)
            loss.backward()
            total += float(loss.detach())
            sums.update({k: sums.get(k, 0.0) + float(v) for k, v in stats.items()})
        clip = self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        self.optimizer.step()
        return StepResult(total, sums, grad_norm)

    def microbatches(self, batch: Batch) -> tuple[Layout, list[Batch]]:
        """The batch's layout and its consecutive rows of at most ``micro_batch_tokens`` tokens run in it."""
        layout = choose_layout(self.model, batch)
        plan = micro_batch_plan(batch, layout, self.micro_batch_tokens)
        return layout, [batch] if len(plan) == 1 else [rows_of(batch, rows) for rows in plan]

    @torch.no_grad()
    def forward(self, batch: Batch, *, entropy: bool = False) -> dict[str, torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        try:
            layout, mbs = self.microbatches(batch)
            parts = [vars(local_outputs(self.model, mb, entropy, self.temperature, layout)) for mb in mbs]
        finally:
            self.model.train(was_training)
        return {k: torch.cat([p[k] for p in parts]) for k, v in parts[0].items() if v is not None}

    def sync_engine_model(self) -> None:
        pass

    def comm_metrics(self) -> dict[str, int]:
        return {}  # one process: no collectives

    def params_finite(self) -> bool:
        return params_finite(self.model.parameters())

    def load(self, ckpt_dir: Path, state: dict[str, Any] | None = None) -> None:
        """Restore optimizer and RNG state from ``trainer_state.pt``'s dict (weights come with the model)."""
        if self.optimizer is None or state is None:
            return
        if "optimizer" not in state:
            raise ValueError(
                f"{ckpt_dir} was written by a parallel run: resume it under torchrun with the same "
                "layout, or start over with --no-resume"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])

    def save(self, ckpt_dir: Path, tokenizer: Tokenizer | None, state: dict[str, Any]) -> None:
        extra = {"optimizer": self.optimizer.state_dict()} if self.optimizer is not None else {}
        save_checkpoint(ckpt_dir, self.model, tokenizer, {**state, **extra, "rng": rng_state()})


def _holds_full_weights(trainer: ParallelTrainer) -> bool:
    return trainer.pm.dp_kind in ("ddp", "zero1", "zero2") and trainer.dims.tp == 1 and trainer.dims.pp == 1


class ParallelLearner:
    """``model`` on the parallel trainer, one per rank (see the module docstring). ``engine_copy``: where a full
    model for generation is kept — ``"main"`` (rank 0 only: evaluation), ``"all"`` (every rank: RL rollouts) or
    ``"none"``."""

    distributed = True

    def __init__(
        self,
        model: Transformer,
        optim: OptimConfig | None,
        parallel: ParallelConfig,
        dims: ParallelDims | None = None,
        *,
        engine_copy: str = "main",
        temperature: float = 1.0,
    ) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.is_main = self.rank == 0
        wants = engine_copy == "all" or (engine_copy == "main" and self.is_main)
        copy_before = materialised_copy(model) if wants else None  # before parallelize cuts and shards ``model``

        def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
            # The trainer applies the weight decay (matrices only), as build_adamw's parameter groups do.
            assert optim is not None
            params = list(params)
            return torch.optim.AdamW(
                params,
                lr=optim.lr,
                betas=ADAMW_BETAS,
                eps=ADAMW_EPS,
                weight_decay=0.0,
                **adamw_kernel(params, optim.fused),
            )

        clip = None if optim is None else (optim.grad_clip if optim.grad_clip > 0 else math.inf)
        self.trainer = ParallelTrainer(
            model,
            adamw if optim is not None else None,
            parallel,
            dims,
            max_grad_norm=clip,
            weight_decay=optim.weight_decay if optim else 0.0,
            decays=decays,
        )
        self.trainer.temperature = temperature
        self.shares_weights = wants and _holds_full_weights(self.trainer)
        # LoRA: an engine copy holds the frozen base already, so syncs and saves gather the adapters alone (the
        # same choice on every rank: the gathers are collective).
        self.frozen_base = engine_copy != "none" and any(not p.requires_grad for p in model.parameters())
        self.engine_model = model if self.shares_weights else copy_before  # type: ignore[assignment]

    @property
    def dims(self) -> ParallelDims:
        return self.trainer.dims

    def train_step(self, batch: Batch, loss_fn: LossFn, lr: float, *, entropy: bool = False) -> StepResult:
        self.trainer.set_lr(lr)
        return self.trainer.train_step(batch, loss_fn, entropy=entropy)

    def forward(self, batch: Batch, *, entropy: bool = False) -> dict[str, torch.Tensor]:
        return self.trainer.forward(batch, entropy=entropy)

    def sync_engine_model(self) -> None:
        """Gather the full weights into the engine copy (collective: every rank calls it)."""
        if self.shares_weights:
            return
        full = self.trainer.full_state_dict(self.frozen_base)
        if self.engine_model is not None:
            self.engine_model.load_state_dict(full, strict=not self.frozen_base)

    def comm_metrics(self) -> dict[str, int]:
        """This rank's cumulative collective counters per axis (``comm/tp/all_reduce/bytes``, ...); loops log the
        difference over a step (:func:`~spinwheel.parallel.comm.metrics_since`)."""
        return self.dims.comm.stats.metrics()

    def params_finite(self) -> bool:
        """Whether this rank's parameters (its shards) are finite; the harness agrees over ranks."""
        return params_finite(self.trainer.pm.module.parameters())

    def load(self, ckpt_dir: Path, state: dict[str, Any] | None = None) -> None:
        shards = ckpt_dir / SHARDED_DIR
        if not shards.is_dir():
            raise ValueError(
                f"{ckpt_dir} holds no sharded trainer state (a single-process checkpoint): resume it "
                "without torchrun, or start over with --no-resume"
            )
        self.trainer.load(str(shards))
        set_rng_state(torch.load(shards / f"rng{self.rank:05d}.pt", map_location="cpu", weights_only=False))

    def save(self, ckpt_dir: Path, tokenizer: Tokenizer | None, state: dict[str, Any]) -> None:
        """Write the checkpoint (collective; :func:`~spinwheel.train.parallel_checkpoint.save_parallel`: streamed
        tensor by tensor where no rank holds the full weights); ``save_stats``: each rank's figures of a streamed
        save (``save_peak_mb``, ``save_model_mb``, ``save_s``), by rank."""
        self.save_stats = save_parallel(self, ckpt_dir, tokenizer, state)


def minibatch_updates(
    learner: Learner,
    rows: Batch,
    loss_fn: LossFn,
    *,
    epochs: int,
    minibatches: int,
    seed: int,
    weights: Callable[[torch.Tensor], torch.Tensor],
    lr: Callable[[int], float],
    after: Callable[[Batch, torch.Tensor, float], dict[str, float]] | None = None,
) -> dict[str, float]:
    """``epochs`` passes of ``minibatches`` optimizer steps over a batch of rows (PPO's update loop, as verl's actor
    runs it): each epoch shuffles the rows (generator seeded ``seed + epoch``; one minibatch: the batch in its order,
    no copies), ``weights(mask)`` gives a minibatch's token weights from ``rows["mask"]``, ``lr(n)`` the learning rate
    of the n-th step and ``after(mb, mask, lr)`` runs after each step (PPO's critic). Returns the mean figures."""
    b = rows["input_ids"].shape[0]
    size = b // minibatches
    sums: dict[str, float] = {}
    n = 0
    for epoch in range(epochs):
        order = torch.randperm(b, generator=torch.Generator().manual_seed(seed + epoch)) if minibatches > 1 else None
        for k in range(minibatches):
            if order is None:
                mb, mask = {key: v for key, v in rows.items() if key != "mask"}, rows["mask"]
            else:
                picked = order[k * size : (k + 1) * size].to(rows["input_ids"].device)
                mb = {key: v[picked] for key, v in rows.items() if key != "mask"}
                mask = rows["mask"][picked]
            mb["weights"] = weights(mask)
            rate = lr(n)
            out = learner.train_step(mb, loss_fn, rate, entropy=True)
            extra = after(mb, mask, rate) if after is not None else {}
            figures = {**out.stats, **extra, "loss": out.loss, "grad_norm": out.grad_norm or 0.0, "lr": rate}
            for key, v in figures.items():
                sums[key] = sums.get(key, 0.0) + v
            n += 1
    return {key: v / n for key, v in sums.items()}


def params_finite(params: Iterator[torch.Tensor]) -> bool:
    """Whether every tensor of ``params`` is finite (one reduction each, no copies)."""
    return all(bool(torch.isfinite(p).all()) for p in params)


def is_main_process() -> bool:
    """Rank 0 of the initialised world, else of torchrun's environment (before the world is joined), else True."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


@contextmanager
def distributed_world(device: str, parallel: ParallelConfig) -> Iterator[bool]:
    """Join the torchrun world when it has more than one process (NCCL for a CUDA device, gloo otherwise) and leave
    it again at the end (if this call joined it); yields whether the run is distributed. In one process, parallel
    degrees > 1 are refused and options with nothing to shard over are named in a warning."""
    if launched_world_size() <= 1:
        if ignored := parallel.check_one_process():
            logger.warning(
                "%s: ignored in a one-process run (nothing to shard or pipeline over); launch with torchrun to use %s",
                ", ".join(ignored),
                "them" if len(ignored) > 1 else "it",
            )
        yield False
        return
    joined = not dist.is_initialized()
    init_distributed("nccl" if device.startswith("cuda") else "gloo", timeout_s=parallel.timeout_s)
    try:
        yield True
        dist.barrier()  # leave together: tearing down groups while a peer still evaluates can abort gloo's threads
    finally:
        if joined:
            destroy_distributed()
