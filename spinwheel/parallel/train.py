"""The parallel training step the trainers call (SFT, and the RL trainers' updates).

    dims = ParallelDims.create(...)                    # or let ParallelTrainer build it from the config
    trainer = ParallelTrainer(model, lambda params: torch.optim.AdamW(params, lr=1e-3), ParallelConfig(tp=2))
    loss = trainer.step(input_ids, labels, loss_mask)  # the *global* batch, identical on every rank

Loss convention: ``loss = Σ mask·CE(logits, labels) / Σ mask`` over the whole global batch — the value
single-process training of the same batch gives, whatever the layout. ``labels`` are aligned with ``input_ids``
(position t predicts ``labels[:, t]``; shift before calling). Each rank takes its data-parallel slice of the rows,
then ``microbatches`` slices of that: pipeline micro-batches when pp > 1, gradient accumulation (``no_sync``)
otherwise. The returned loss is the global one, on every rank.

Around the optimizer step (see :mod:`spinwheel.parallel.optim`): ``max_grad_norm`` clips by the norm of the whole
gradient across every shard (``trainer.grad_norm`` holds the norm before clipping; ``math.inf`` measures without
clipping); ``weight_decay`` applies AdamW's decoupled decay to the parameters ``decays(name, ndim)`` selects — build
the optimizer with ``weight_decay=0`` then, since flat shards mix matrices and norm gains. :meth:`set_lr` sets the
learning rate of whatever optimizer the layout built (ZeRO's wraps the inner one), for warmup/cosine schedules.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.config import option
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import ParallelDims, ParallelError
from spinwheel.parallel.optim import DecayRule, apply_weight_decay, clip_grad_norm_
from spinwheel.parallel.parallelize import ParallelModel, parallelize
from spinwheel.parallel.pipeline import sync_tied_weights
from spinwheel.parallel.tensor import vocab_parallel_cross_entropy

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@dataclass
class ParallelConfig:
    """Distributed training layout (run under torchrun; the product dp·tp·pp must equal the number of processes)."""

    dp: int = option(-1, help="data-parallel degree; -1 = world size / (tp·pp)")
    tp: int = option(1, help="tensor-parallel degree (Megatron): splits heads, MLP and vocabulary")
    pp: int = option(1, help="pipeline-parallel degree: number of stages the layers are cut into")
    zero: int = option(0, help="ZeRO stage over the data-parallel axis: 0 = DDP, 1 = optimizer state sharded, "
                               "2 = + gradients, 3 = + parameters", choices=(0, 1, 2, 3))
    fsdp: bool = option(False, help="fully sharded data parallel (units per block, prefetch) instead of DDP/ZeRO")
    hsdp: int = option(0, help="hybrid sharding: shard within groups of this many data-parallel ranks and "
                               "replicate across groups (implies --fsdp); 0 = off")
    microbatches: int = option(1, help="micro-batches per step: pipeline micro-batches with pp > 1, gradient "
                                       "accumulation otherwise")
    schedule: Literal["gpipe", "1f1b"] = option("1f1b", help="pipeline schedule")
    remat: bool = option(False, help="re-materialise (checkpoint) each block's activations in backward")
    bucket_mb: float = option(25.0, help="gradient bucket size cap in MiB (DDP, ZeRO-1/2)")
    timeout_s: float = option(600.0, help="collective timeout in seconds: a dead rank fails the job after this")

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "microbatches"):
            if getattr(self, name) < 1:
                raise ParallelError(f"--{name} must be ≥ 1, got {getattr(self, name)}")
        if self.dp == 0 or self.dp < -1:
            raise ParallelError(f"--dp must be ≥ 1 or -1 (fill the world), got {self.dp}")
        if self.zero not in (0, 1, 2, 3):
            raise ParallelError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.hsdp < 0:
            raise ParallelError(f"--hsdp must be ≥ 0, got {self.hsdp}")
        if self.hsdp:
            self.fsdp = True
        if self.fsdp and self.zero:
            raise ParallelError("--fsdp/--hsdp and --zero are alternatives (ZeRO-3 is FSDP without prefetch); "
                                "pick one")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ParallelError(f"--schedule must be gpipe or 1f1b, got {self.schedule!r}")

    def make_dims(self) -> ParallelDims:
        """Build the rank grid (and process groups) for this layout from the initialised world."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        dp = self.dp if self.dp != -1 else world // (self.tp * self.pp)
        if dp < 1 or dp * self.tp * self.pp != world:
            raise ParallelError(f"dp={self.dp} × tp={self.tp} × pp={self.pp} does not match the world of {world} "
                                "processes; change the degrees or the number of processes (torchrun "
                                "--nproc-per-node N)")
        shard = self.hsdp if self.hsdp else dp
        if dp % shard:
            raise ParallelError(f"--hsdp {self.hsdp} must divide the data-parallel degree {dp}")
        return ParallelDims.create(dp_replicate=dp // shard, dp_shard=shard, tp=self.tp, pp=self.pp,
                                   timeout_s=self.timeout_s, comm=Comm(self.timeout_s))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   pm: ParallelModel) -> torch.Tensor:
    """Σ mask · CE over a micro-batch; logits are vocab-sharded when tp > 1 (never gathered)."""
    tp_axis = pm.dims.tp_axis
    if tp_axis.size > 1:
        ce = vocab_parallel_cross_entropy(logits, labels, tp_axis, pm.dims.comm)
    else:
        ce = F.cross_entropy(logits.float().flatten(0, -2), labels.reshape(-1), reduction="none").view(labels.shape)
    return (ce * loss_mask.to(ce.dtype)).sum()


class ParallelTrainer:
    """Owns the parallelized model and its optimizer; :meth:`step` runs one optimizer step on a global batch."""

    def __init__(self, model: nn.Module, optimizer_factory: OptimizerFactory, config: ParallelConfig,
                 dims: ParallelDims | None = None, *, max_grad_norm: float | None = None, weight_decay: float = 0.0,
                 decays: DecayRule | None = None) -> None:
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 (math.inf: measure only; None: off), got {max_grad_norm}")
        self.config = config
        self.dims = dims or config.make_dims()
        self.pm = parallelize(model, self.dims, zero=config.zero, fsdp=config.fsdp, remat=config.remat,
                              bucket_mb=config.bucket_mb, schedule=config.schedule)
        self.optimizer = self.pm.module.make_optimizer(optimizer_factory)
        self.max_grad_norm = max_grad_norm
        self.weight_decay = weight_decay
        self.decays: DecayRule = decays or (lambda name, ndim: True)
        self.grad_norm: float | None = None  # global gradient norm of the last step (with max_grad_norm set)
        self.report = Comm(config.timeout_s)  # loss and norm reporting, kept out of the strategies' volume counters
        self.num_steps = 0

    @property
    def model_config(self):
        return self.pm.stage.config

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> float:
        """One optimizer step on the global batch (B, T) — the same tensors on every rank. Returns the global loss."""
        loss = self.forward_backward(input_ids, labels, loss_mask)
        if self.max_grad_norm is not None:
            self.grad_norm = self.clip_grad_norm_(self.max_grad_norm)
        if self.weight_decay:
            apply_weight_decay(self.pm, self.optimizer.param_groups[0]["lr"], self.weight_decay, self.decays)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        return loss

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the reduced gradients to global norm ``max_norm``; returns the norm before clipping (collective)."""
        return clip_grad_norm_(self.pm, max_norm, self.report)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group (one rate for all, as the LR schedules give)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> float:
        """Gradients of the global loss, reduced as the layout needs; returns the global loss (no optimizer step)."""
        dims, pm, m = self.dims, self.pm, self.config.microbatches
        dp_axis = dims.dp_axis
        b = input_ids.shape[0]
        if b % (dp_axis.size * m):
            raise ParallelError(f"global batch {b} must be divisible by dp × microbatches = {dp_axis.size} × {m}")
        count = loss_mask.sum().clamp(min=1).to(torch.float32)  # tokens in the global batch
        rows = slice(dp_axis.rank * (b // dp_axis.size), (dp_axis.rank + 1) * (b // dp_axis.size))
        ids, lab, mask = input_ids[rows], labels[rows], loss_mask[rows]
        # Data-parallel wrappers average gradients over dp, so each rank's loss is scaled by dp.
        scale = dp_axis.size / count
        ids_mb, lab_mb, mask_mb = ids.chunk(m), lab.chunk(m), mask.chunk(m)
        total = torch.zeros((), dtype=torch.float32, device=input_ids.device)  # NCCL reduces device tensors
        if pm.pipeline is not None:
            def loss_fn(out: torch.Tensor, i: int) -> torch.Tensor:
                return token_loss_sum(out, lab_mb[i], mask_mb[i], pm) * scale

            with pm.module.no_sync():
                total = pm.pipeline.step(list(ids_mb), loss_fn, module=pm.module)
            sync_tied_weights(pm.stage, dims.pp_ends_axis, dims.comm)
            pm.module.sync_gradients()
        else:
            for i in range(m):
                ctx = pm.module.no_sync() if i < m - 1 else nullcontext()
                with ctx:
                    logits = pm.module(ids_mb[i])
                    loss = token_loss_sum(logits, lab_mb[i], mask_mb[i], pm) * scale
                    loss.backward()
                total = total + loss.detach().float()
        # The global loss: the last stage holds it; each dp rank holds its dp-scaled share.
        if pm.pipeline is not None and dims.pp_axis.rank != dims.pp_axis.size - 1:
            total = torch.zeros((), dtype=torch.float32, device=input_ids.device)
        total = total.to(input_ids.device).reshape(1) / dp_axis.size
        self.report.all_reduce(total, dp_axis)
        self.report.all_reduce(total, dims.pp_axis)
        return float(total.item())

    # -- checkpoints (see spinwheel.parallel.checkpoint) -----------------------------------------------------------
    def save(self, path: str) -> None:
        from spinwheel.parallel.checkpoint import save_sharded
        save_sharded(self, path)

    def load(self, path: str) -> None:
        from spinwheel.parallel.checkpoint import load_sharded
        load_sharded(self, path)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from spinwheel.parallel.checkpoint import full_state_dict
        return full_state_dict(self.pm)

    def save_hf(self, path: str) -> None:
        from spinwheel.parallel.checkpoint import save_hf
        save_hf(self.pm, path)


def train_step(trainer: ParallelTrainer, input_ids: torch.Tensor, labels: torch.Tensor,
               loss_mask: torch.Tensor) -> float:
    """Functional alias of :meth:`ParallelTrainer.step`."""
    return trainer.step(input_ids, labels, loss_mask)
