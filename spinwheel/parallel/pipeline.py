"""Pipeline parallelism: GPipe (Huang et al., 2019) and 1F1B (PipeDream-Flush; Narayanan et al., 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2.2).

The layer stack is cut into K balanced stages (:func:`stage_layer_ranges`); stage 0 also holds the embedding, stage
K−1 the final norm and head. A mini-batch is split into M micro-batches. Stages exchange activations (forward) and
their gradients (backward) point-to-point over the ``pp`` axis: sends are non-blocking, receives blocking, and every
pair of stages sends and receives in the same order, so neither schedule can deadlock.

* **GPipe**: all M forwards, then all M backwards. Stored activations peak at M micro-batches.
* **1F1B**: stage s runs K−s−1 warm-up forwards, then alternates one forward / one backward, then drains. At most
  K−s micro-batches are in flight, so peak stored activations are K/M of GPipe's for M ≥ K.

Both leave the same idle "bubble" per stage: (K−1)/(M+K−1) of the step (:func:`bubble_fraction`). The schedule
records the compute intervals of each stage so the bubble can be measured, and (optionally) the bytes autograd
saves per micro-batch, with the stage input the schedule keeps for it, so peak activation memory can be measured.

Tied embeddings across stages (the head on stage K−1 uses stage 0's embedding matrix) are kept as two copies whose
gradients are summed over the first/last-stage group (:func:`sync_tied_weights`), as Megatron-LM does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from spinwheel.models.transformer import AttentionMask, run_blocks
from spinwheel.parallel.comm import Comm, Handle
from spinwheel.parallel.mesh import Axis

Schedule = Literal["gpipe", "1f1b"]


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction of a pipeline step with equal stage costs: (K−1)/(M+K−1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Consecutive, balanced layer ranges (sizes differ by at most one; earlier stages take the extra layers)."""
    if num_stages > num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} pipeline stages; use pp ≤ {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of a :class:`~spinwheel.models.transformer.Transformer`.

    Holds the model's own submodules under their original names (``layers`` is a ModuleDict keyed by the original
    layer index), so state-dict keys match the full model. Forward: token ids (B, T) on stage 0 or hidden states
    (B, T, C) elsewhere -> hidden states, or logits (B, T, V) on the last stage. Plain causal attention only
    (right-padded batches whose padding is masked in the loss).
    """

    def __init__(self, model: nn.Module, stage: int, num_stages: int) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.config = model.config
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.layer_range = stage_layer_ranges(len(model.layers), num_stages)[stage]
        self.tied = bool(model.config.tie_word_embeddings) and num_stages > 1
        self.embed_tokens = model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_range})
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        if self.is_last and self.tied and not self.is_first:
            tied = model.lm_head.weight  # the last stage's copy, trained as the embedding is (frozen under LoRA)
            self.lm_head.weight = nn.Parameter(tied.detach().clone(), requires_grad=tied.requires_grad)
        self.rotary = model.rotary

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (B, T) -> (B, T, C)
        b, t = x.shape[:2]
        if positions is None:
            positions = torch.arange(t, device=x.device).expand(b, t)
        x = run_blocks(self.layers.values(), self.rotary, x, positions, AttentionMask(None))
        if self.is_last:
            x = self.lm_head(self.norm(x))  # (B, T, V)
        return x


def tied_weight(stage: nn.Module) -> torch.Tensor | None:
    """The tied embedding/head weight this stage holds (first: the embedding, last: the head), if any."""
    if not getattr(stage, "tied", False):
        return None
    if stage.embed_tokens is not None:
        return stage.embed_tokens.weight
    return stage.lm_head.weight if stage.lm_head is not None else None


def sync_tied_weights(stage: nn.Module, axis: Axis, comm: Comm) -> None:
    """Sum the tied weight's gradient over the first/last-stage group (``ParallelDims.pp_ends_axis``)."""
    w = tied_weight(stage)
    if w is not None and w.requires_grad and axis.size > 1:
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        comm.all_reduce(w.grad, axis)


@dataclass
class PipelineStats:
    """What one step of the schedule did on this stage (times from ``time.monotonic``, shared by local ranks)."""

    start: float = 0.0
    end: float = 0.0
    busy: float = 0.0  # seconds spent in forward/backward compute
    intervals: list[tuple[str, int, float, float]] = field(default_factory=list)  # (op, micro-batch, start, end)
    max_in_flight: int = 0  # micro-batches forwarded but not yet backwarded, at most
    peak_activation_bytes: int = 0  # bytes autograd saved for in-flight micro-batches, at most (a storage once)

    def bubble(self, start: float | None = None, end: float | None = None) -> float:
        """Idle fraction of [start, end] (default: this stage's own step window)."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        return 1.0 - self.busy / (end - start)


def schedule_order(schedule: Schedule, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The order stage ``stage`` runs its forwards ("F", i) and backwards ("B", i) in.

    GPipe: every forward, then every backward. 1F1B: K−s−1 warm-up forwards, then one forward / one backward
    alternating, then the remaining backwards (the drain).
    """
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(num_stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


class ActivationLedger:
    """The bytes autograd saved for the micro-batches in flight, and their peak over a step.

    A storage is counted once however many in-flight micro-batches saved it (one re-materialisation buffer that
    every checkpoint is a view of), and parameters are not activations. Disabled, it records nothing.
    """

    def __init__(self, module: nn.Module, enabled: bool) -> None:
        self.enabled = enabled
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()} if enabled else set()
        self.stored: dict[int, dict[int, int]] = {}  # micro-batch -> the storages it saved (data_ptr -> bytes)
        self.held: dict[int, int] = {}  # storage -> how many in-flight micro-batches hold it
        self.live = 0
        self.peak = 0

    def run(self, module: nn.Module, x: torch.Tensor, seen: dict[int, int]) -> torch.Tensor:
        """``module(x)``, recording into ``seen`` each non-parameter storage autograd saves."""
        if not self.enabled:
            return module(x)

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.param_ptrs:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return module(x)

    def hold(self, i: int, seen: dict[int, int]) -> None:
        """Micro-batch i keeps ``seen`` alive until its backward."""
        self.stored[i] = seen
        for ptr, nbytes in seen.items():
            if ptr not in self.held:
                self.live += nbytes
            self.held[ptr] = self.held.get(ptr, 0) + 1
        self.peak = max(self.peak, self.live)

    def release(self, i: int) -> None:
        """Micro-batch i's backward ran: what only it held is freed."""
        for ptr, nbytes in self.stored.pop(i).items():
            self.held[ptr] -= 1
            if not self.held[ptr]:
                del self.held[ptr]
                self.live -= nbytes


@dataclass
class _StepState:
    """What one step keeps between a micro-batch's forward and its backward."""

    run: nn.Module
    microbatches: list[torch.Tensor]
    loss_fn: Callable[[torch.Tensor, int], torch.Tensor]
    ledger: ActivationLedger
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # the stage input x, for x.grad
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # the stage output (the loss on the last stage)
    sends: list[tuple[Handle, torch.Tensor]] = field(default_factory=list)  # kept alive until the sends complete
    total: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))


class PipelineSchedule:
    """Runs one training step of ``stage`` over micro-batches with the GPipe or 1F1B schedule."""

    def __init__(
        self,
        stage: nn.Module,
        axis: Axis,
        comm: Comm,
        schedule: Schedule = "1f1b",
        hidden_size: int | None = None,
        dtype: torch.dtype | None = None,
        track_activations: bool = False,
    ) -> None:
        if schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"unknown pipeline schedule '{schedule}': use 'gpipe' or '1f1b'")
        self.stage, self.axis, self.comm, self.schedule = stage, axis, comm, schedule
        config = getattr(stage, "config", None)
        self.hidden_size = hidden_size or config.hidden_size
        self.dtype = dtype or next(p for p in stage.parameters()).dtype
        self.track_activations = track_activations
        self.stats = PipelineStats()

    @property
    def is_first(self) -> bool:
        return self.axis.rank == 0

    @property
    def is_last(self) -> bool:
        return self.axis.rank == self.axis.size - 1

    def step(
        self,
        microbatches: list[torch.Tensor],
        loss_fn: Callable[[torch.Tensor, int], torch.Tensor],
        module: nn.Module | None = None,
    ) -> torch.Tensor:
        """Forward and backward every micro-batch; returns the summed loss on the last stage (0 elsewhere).

        ``microbatches``: token ids (b, T) per micro-batch (later stages use only their shapes); ``loss_fn(out, i)``
        maps the last stage's output for micro-batch i to a scalar that is already scaled for summation.
        ``module`` is what to call (e.g. a data-parallel wrapper around the stage); default the stage itself.
        """
        run = module or self.stage
        state = _StepState(run, microbatches, loss_fn, ActivationLedger(run, self.track_activations))
        self.stats = PipelineStats(start=time.monotonic())
        for op, i in schedule_order(self.schedule, self.axis.size, self.axis.rank, len(microbatches)):
            if op == "F":
                self._forward(state, i)
            else:
                self._backward(state, i)
        for handle, _ in state.sends:
            handle.wait()
        self.stats.end = time.monotonic()
        return state.total

    def _receive_input(self, ids: torch.Tensor) -> torch.Tensor:
        """Stage 0's input is the token ids; a later stage's is the previous stage's activations (b, T, C)."""
        if self.is_first:
            return ids
        x = torch.empty(*ids.shape, self.hidden_size, dtype=self.dtype)  # (b, T, C)
        self.comm.recv(x, self.axis, self.axis.rank - 1)
        return x.requires_grad_(True)

    def _forward(self, state: _StepState, i: int) -> None:
        """Micro-batch i's forward: receive, compute (the loss on the last stage), send on, keep for the backward."""
        stats = self.stats
        x = self._receive_input(state.microbatches[i])
        t0 = time.monotonic()
        seen: dict[int, int] = {}
        out = state.ledger.run(state.run, x, seen)
        if not self.is_first and getattr(self.stage, "remat_input_copied", False):
            # Re-materialised stage whose checkpoint keeps its own (partitioned) copy of x: the schedule holds
            # x only to collect x.grad, which needs its shape, not its values.
            x.untyped_storage().resize_(0)
        if state.ledger.enabled:  # x itself stays alive until this micro-batch's backward
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        if self.is_last:
            loss = state.loss_fn(out, i)
            state.total = state.total + loss.detach().float()
            out = loss
        t1 = time.monotonic()
        stats.busy += t1 - t0
        stats.intervals.append(("F", i, t0, t1))
        if not self.is_last:
            sent = out.detach()
            state.sends.append((self.comm.isend(sent, self.axis, self.axis.rank + 1), sent))
        state.inputs[i], state.outputs[i] = x, out
        state.ledger.hold(i, seen)
        stats.peak_activation_bytes = state.ledger.peak
        stats.max_in_flight = max(stats.max_in_flight, len(state.outputs))

    def _backward(self, state: _StepState, i: int) -> None:
        """Micro-batch i's backward: receive the output's gradient (the last stage starts from its loss), compute,
        send the input's gradient back."""
        out, x = state.outputs.pop(i), state.inputs.pop(i)
        if self.is_last:
            t0 = time.monotonic()
            out.backward()
        else:
            grad = torch.empty_like(out)
            self.comm.recv(grad, self.axis, self.axis.rank + 1)
            t0 = time.monotonic()
            torch.autograd.backward(out, grad)
        t1 = time.monotonic()
        self.stats.busy += t1 - t0
        self.stats.intervals.append(("B", i, t0, t1))
        if not self.is_first:
            state.sends.append((self.comm.isend(x.grad, self.axis, self.axis.rank - 1), x.grad))
        state.ledger.release(i)

    @torch.no_grad()
    def forward_only(
        self,
        microbatches: list[torch.Tensor],
        out_fn: Callable[[torch.Tensor, int], None],
        module: nn.Module | None = None,
    ) -> None:
        """Forward every micro-batch through the stages without autograd (log-probs of old or reference policies):
        ``out_fn(out, i)`` receives the last stage's output for micro-batch i; nothing is kept for a backward."""
        run = module or self.stage
        k, s = self.axis.size, self.axis.rank
        sends: list[tuple[Handle, torch.Tensor]] = []
        for i, ids in enumerate(microbatches):
            if s == 0:
                x = ids
            else:
                x = torch.empty(*ids.shape, self.hidden_size, dtype=self.dtype)  # (b, T, C)
                self.comm.recv(x, self.axis, s - 1)
            out = run(x)
            if s == k - 1:
                out_fn(out, i)
            else:
                sends.append((self.comm.isend(out, self.axis, s + 1), out))
        for handle, _ in sends:
            handle.wait()
