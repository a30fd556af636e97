"""The parallel trainer: one optimizer step (or one forward) of a global batch under any layout, with a pluggable
per-token loss — what SFT, the LLM RL algorithms, DPO and reward-model training all run on.

    trainer = ParallelTrainer(model, lambda params: torch.optim.AdamW(params, lr=1e-3), ParallelConfig(tp=2))
    result = trainer.train_step(batch, loss_fn)    # the *global* batch, identical on every rank
    out = trainer.forward(batch)                   # per-token log-probs (B, T), no gradient, on every rank
    frozen = ParallelTrainer(ref_model, None, config)  # no optimizer: a frozen (reference) model, forward only

**Batches** are dicts of tensors whose first dim is the global batch B: ``input_ids`` (B, T) and ``labels``
(B, T) aligned (position t predicts ``labels[:, t]``; shift before calling), plus any per-token or per-row tensors
the loss reads (weights, advantages, old/reference log-probs, ...). Rows are right-padded: with causal attention a
real token never sees a pad, so no attention mask is needed and every layout (pipelines included) runs them.

**Losses** (``LossFn``) get :class:`~spinwheel.parallel.token_outputs.TokenOutputs` of one micro-batch and the
micro-batch's slice of the batch, and return ``(loss, stats)``: the micro-batch's *contribution* to the global
loss — a sum over its tokens with weights computed from the whole global batch beforehand (e.g. ``mask / Σ mask``
for a token mean) — and stats as contributions the same way. Sums over micro-batches and data-parallel ranks then
give exactly the single-process values, whatever the layout. Each rank takes its data-parallel slice of the rows,
then ``microbatches`` slices of that: pipeline micro-batches when pp > 1, gradient accumulation (``no_sync``)
otherwise. Returned losses and stats are global, on every rank.

Around the optimizer step (see :mod:`spinwheel.parallel.optim`): ``max_grad_norm`` clips by the norm of the whole
gradient across every shard (``math.inf`` measures without clipping); ``weight_decay`` applies AdamW's decoupled
decay to the parameters ``decays(name, ndim)`` selects — build the optimizer with ``weight_decay=0`` then, since
flat shards mix matrices and norm gains. :meth:`set_lr` sets the learning rate of whatever optimizer the layout
built (ZeRO's wraps the inner one), for warmup/cosine schedules.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from spinwheel.parallel.comm import Comm
from spinwheel.parallel.config import ParallelConfig
from spinwheel.parallel.mesh import ParallelDims, ParallelError
from spinwheel.parallel.optim import DecayRule, apply_weight_decay, clip_grad_norm_
from spinwheel.parallel.parallelize import parallelize
from spinwheel.parallel.pipeline import sync_tied_weights
from spinwheel.parallel.token_outputs import TokenOutputs, is_scalar_head, token_outputs

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
Batch = dict[str, torch.Tensor]
LossFn = Callable[[TokenOutputs, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def nll_loss(out: TokenOutputs, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted next-token negative log-likelihood ``−Σ weights · log p(labels)`` (SFT's loss with
    ``weights = loss_mask / Σ loss_mask`` over the global batch)."""
    assert out.logprobs is not None
    loss = -(out.logprobs * batch["weights"]).sum()
    return loss, {}


@dataclass
class StepResult:
    loss: float  # the global loss
    stats: dict[str, float] = field(default_factory=dict)  # global sums of the loss's stats
    grad_norm: float | None = None  # global gradient norm before clipping (with max_grad_norm set)


class ParallelTrainer:
    """Owns the parallelized model and its optimizer (none for a frozen model); see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: OptimizerFactory | None,
        config: ParallelConfig,
        dims: ParallelDims | None = None,
        *,
        max_grad_norm: float | None = None,
        weight_decay: float = 0.0,
        decays: DecayRule | None = None,
    ) -> None:
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 (math.inf: measure only; None: off), got {max_grad_norm}")
        self.config = config
        self.dims = dims or config.make_dims()
        self.scalar_head = is_scalar_head(model.config)
        self.temperature = 1.0  # log-probs of logits / T (an RL learner sets its rollouts' temperature)
        self.pm = parallelize(
            model,
            self.dims,
            zero=config.zero,
            fsdp=config.fsdp,
            remat=config.remat,
            bucket_mb=config.bucket_mb,
            schedule=config.schedule,
            mixed_precision=config.mixed_precision(),
            fsdp_buffer_mb=config.fsdp_buffer_mb or None,
            remat_k=config.remat_k,
            remat_partition=config.remat_partition,
            remat_contiguous=config.remat_contiguous,
        )
        self.optimizer = self.pm.module.make_optimizer(optimizer_factory) if optimizer_factory else None
        self.max_grad_norm = max_grad_norm
        self.weight_decay = weight_decay
        self.decays: DecayRule = decays or (lambda name, ndim: True)
        self.grad_norm: float | None = None  # global gradient norm of the last step (with max_grad_norm set)
        self.report = Comm(config.timeout_s)  # loss and stats reporting, kept out of the strategies' counters
        self.num_steps = 0

    @property
    def model_config(self):
        return self.pm.stage.config

    # -- training ---------------------------------------------------------------------------------------------------
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> float:
        """One step of the token-mean NLL ``Σ mask·CE / Σ mask`` on the global batch; returns the global loss."""
        weights = loss_mask.float() / loss_mask.sum().clamp(min=1).float()
        return self.train_step({"input_ids": input_ids, "labels": labels, "weights": weights}, nll_loss).loss

    def train_step(self, batch: Batch, loss_fn: LossFn, *, entropy: bool = False) -> StepResult:
        """Gradients of the global loss, then clip, weight decay and the optimizer step (see the module docstring)."""
        if self.optimizer is None:
            raise ParallelError("this trainer is frozen (built without an optimizer): it can only run forward()")
        loss, stats = self.loss_backward(batch, loss_fn, entropy=entropy)
        if self.max_grad_norm is not None:
            self.grad_norm = self.clip_grad_norm_(self.max_grad_norm)
        if self.weight_decay:
            apply_weight_decay(self.pm, self.optimizer.param_groups[0]["lr"], self.weight_decay, self.decays)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        return StepResult(loss, stats, self.grad_norm)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the reduced gradients to global norm ``max_norm``; returns the norm before clipping (collective)."""
        return clip_grad_norm_(self.pm, max_norm, self.report)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group (one rate for all, as the LR schedules give)."""
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _local_microbatches(self, batch: Batch) -> list[Batch]:
        """This rank's data-parallel slice of the rows, cut into ``microbatches`` equal parts."""
        b = batch["input_ids"].shape[0]
        dp, m = self.dims.dp_axis, self.config.microbatches
        self.config.check_batch(b, dp.size, what="global batch")
        for k, v in batch.items():
            if v.shape[0] != b:
                raise ValueError(f"batch[{k!r}] has {v.shape[0]} rows, input_ids {b}: every tensor is per row")
        rows = slice(dp.rank * (b // dp.size), (dp.rank + 1) * (b // dp.size))
        local = {k: v[rows] for k, v in batch.items()}
        parts = {k: v.chunk(m) for k, v in local.items()}
        return [{k: parts[k][i] for k in local} for i in range(m)]

    def _outputs(self, out: torch.Tensor, mb: Batch, entropy: bool) -> TokenOutputs:
        if self.temperature != 1.0 and not self.scalar_head:
            out = out / self.temperature  # the policy that samples at temperature T (RL)
        return token_outputs(
            out, mb["labels"], self.dims.tp_axis, self.dims.comm, scalar_head=self.scalar_head, entropy=entropy
        )

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> float:
        """Gradients of the token-mean NLL (no optimizer step); returns the global loss."""
        weights = loss_mask.float() / loss_mask.sum().clamp(min=1).float()
        return self.loss_backward({"input_ids": input_ids, "labels": labels, "weights": weights}, nll_loss)[0]

    def loss_backward(self, batch: Batch, loss_fn: LossFn, *, entropy: bool = False) -> tuple[float, dict[str, float]]:
        """Gradients of the global loss, reduced as the layout needs; returns the global loss and stats."""
        dims, pm = self.dims, self.pm
        mbs = self._local_microbatches(batch)
        device = batch["input_ids"].device
        scale = float(dims.dp_axis.size)  # data-parallel wrappers average gradients over dp
        total = torch.zeros((), dtype=torch.float32, device=device)  # NCCL reduces device tensors
        stat_sums: dict[str, torch.Tensor] = {}

        def micro_loss(out: torch.Tensor, i: int) -> torch.Tensor:
            loss, stats = loss_fn(self._outputs(out, mbs[i], entropy), mbs[i])
            for k, v in stats.items():
                stat_sums[k] = stat_sums.get(k, 0.0) + v.detach().float()
            return loss * scale

        if pm.pipeline is not None:
            with pm.module.no_sync():
                total = pm.pipeline.step([mb["input_ids"] for mb in mbs], micro_loss, module=pm.module)
            sync_tied_weights(pm.stage, dims.pp_ends_axis, dims.comm)
            pm.module.sync_gradients()
        else:
            for i, mb in enumerate(mbs):
                with pm.module.no_sync() if i < len(mbs) - 1 else nullcontext():
                    loss = micro_loss(pm.module(mb["input_ids"]), i)
                    loss.backward()
                total = total + loss.detach().float()
        return self._reduce_report(total / scale, stat_sums, device)

    def _reduce_report(
        self, total: torch.Tensor, stat_sums: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[float, dict[str, float]]:
        """Sum the loss and stats over data-parallel ranks and from the last pipeline stage (collective)."""
        dims = self.dims
        if self.pm.pipeline is not None:
            # Only the last stage computed the loss; the others learn the stat names from it.
            names = self.report.all_gather_object(sorted(stat_sums), dims.pp_axis)[-1]
            if dims.pp_axis.rank != dims.pp_axis.size - 1:
                total = torch.zeros((), dtype=torch.float32, device=device)
                stat_sums = {k: torch.zeros((), dtype=torch.float32, device=device) for k in names}
        keys = sorted(stat_sums)
        packed = torch.stack(
            [total.reshape(())] + [torch.as_tensor(stat_sums[k], device=device).reshape(()) for k in keys]
        ).to(device)
        self.report.all_reduce(packed, dims.dp_axis)
        self.report.all_reduce(packed, dims.pp_axis)
        values = packed.tolist()
        return values[0], dict(zip(keys, values[1:]))

    # -- forward only -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: Batch, *, entropy: bool = False) -> dict[str, torch.Tensor]:
        """Per-token outputs of the global batch without gradients (old-policy / reference log-probs, values):
        ``{"logprobs": (B, T)}`` (``"entropy"`` too when asked) or ``{"values": (B, T)}``, on every rank."""
        dims, pm = self.dims, self.pm
        mbs = self._local_microbatches(batch)
        b, t = batch["input_ids"].shape
        local_b = b // dims.dp_axis.size
        names = ["values"] if self.scalar_head else ["logprobs"] + (["entropy"] if entropy else [])
        device = batch["input_ids"].device
        full = torch.zeros(len(names), b, t, dtype=torch.float32, device=device)
        start = dims.dp_axis.rank * local_b
        results: list[TokenOutputs] = []
        was_training = pm.module.training
        pm.module.eval()
        try:
            if pm.pipeline is not None:
                pm.pipeline.forward_only(
                    [mb["input_ids"] for mb in mbs],
                    lambda out, i: results.append(self._outputs(out, mbs[i], entropy)),
                    module=pm.module,
                )
            else:
                results = [self._outputs(pm.module(mb["input_ids"]), mb, entropy) for mb in mbs]
        finally:
            pm.module.train(was_training)
        row = start
        for r in results:  # empty on pipeline stages other than the last
            for j, name in enumerate(names):
                part = getattr(r, name)
                full[j, row : row + part.shape[0]] = part
            row += names and getattr(r, names[0]).shape[0]
        # Every row is filled on exactly one (dp rank, last pp stage); tp ranks hold equal copies.
        self.report.all_reduce(full, dims.dp_axis)
        self.report.all_reduce(full, dims.pp_axis)
        return dict(zip(names, full.unbind(0)))

    # -- checkpoints (see spinwheel.parallel.io.checkpoint) ------------------------------------------------------------
    def save(self, path: str) -> None:
        from spinwheel.parallel.io.checkpoint import save_sharded

        save_sharded(self, path)

    def load(self, path: str) -> None:
        from spinwheel.parallel.io.checkpoint import load_sharded

        load_sharded(self, path)

    def full_state_dict(self, trained_only: bool = False) -> dict[str, torch.Tensor]:
        from spinwheel.parallel.io.checkpoint import full_state_dict

        return full_state_dict(self.pm, trained_only)

    def save_hf(self, path: str) -> None:
        from spinwheel.parallel.io.checkpoint import save_hf

        save_hf(self.pm, path)
