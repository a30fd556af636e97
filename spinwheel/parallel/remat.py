"""Activation re-materialisation (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost"; GPipe, Huang et
al., 2019, §2.3), in three modes, optionally with ZeRO-R's partitioned checkpoints (Pa, Pa+cpu).

* ``block`` — each transformer block is a checkpointed region: forward keeps only each block's input x (B, T, C);
  backward recomputes one block at a time. Stored: L·|x| for L blocks (plus the shared rotary cos/sin).
* ``every-k`` — regions of k consecutive blocks (Chen et al.'s segments; default k = round(√L)): stored ⌈L/k⌉·|x|,
  at the cost of holding one segment's k blocks of activations while it is recomputed — √L checkpoints and √L
  blocks at a time minimise the sum.
* ``stage`` — GPipe's stage-boundary mode under pipeline parallelism: the whole stage (embedding and head included
  where the stage holds them) is one region, so each in-flight micro-batch keeps only the stage's input (token ids
  on the first stage, the received hidden states elsewhere) and backward recomputes the stage. With partitioned
  checkpoints the schedule frees the received input's storage after the forward (it holds x only for x.grad).

With a :class:`~spinwheel.parallel.remat_partition.PartitionedInput` store, each region's input is kept as this
rank's 1/tp slice (in host memory for Pa+cpu) and all-gathered before recomputation. Either store may keep what it
keeps in one contiguous :class:`~spinwheel.parallel.remat_buffer.CheckpointBuffer` (ZeRO-R's MD).

Regions are :class:`~spinwheel.parallel.remat_region.CheckpointRegion` objects: the first block of a segment opens
one, the last closes it, and the blocks run through their own calls in between. Each block's ``forward`` is
replaced on the instance rather than wrapped in another module, so parameter names — and with them checkpoints, TP
shard maps and FSDP units — stay unchanged, and module hooks (FSDP's gather/free) still run around every block's
call, in forward and in recomputation. Forward passes without autograd (``torch.no_grad``) run the blocks plainly.

:class:`SavedBytes` measures what autograd holds, the figure the modes are compared by.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

from spinwheel.parallel.remat_partition import WholeInput
from spinwheel.parallel.remat_region import CheckpointRegion, InputStore

RematMode = Literal["none", "block", "every-k", "stage"]
PartitionMode = Literal["none", "tp", "tp-cpu"]
REMAT_MODES: tuple[str, ...] = ("none", "block", "every-k", "stage")
PARTITION_MODES: tuple[str, ...] = ("none", "tp", "tp-cpu")


def default_segment_size(num_blocks: int) -> int:
    """Chen et al.'s √L rule: round(√L) blocks per segment (at least 1)."""
    return max(1, round(math.sqrt(num_blocks)))


def segment_ranges(num_blocks: int, k: int) -> list[range]:
    """Consecutive segments of k blocks; the last holds the remainder (⌈L/k⌉ segments in all)."""
    if k < 1:
        raise ValueError(f"re-materialisation segments need k ≥ 1 blocks, got {k}")
    return [range(s, min(s + k, num_blocks)) for s in range(0, num_blocks, k)]


class _Segment:
    """Consecutive modules checkpointed as one region: the first one's call opens it (saving its first argument,
    the activation), the last one's call closes it; backward re-runs them all from the saved input."""

    def __init__(self, modules: list[nn.Module], store: InputStore) -> None:
        self.modules, self.store = modules, store
        self.region: CheckpointRegion | None = None
        self.recomputing = False

    def call(self, index: int, module: nn.Module, *args, **kwargs):
        plain = type(module).forward
        if self.recomputing or not torch.is_grad_enabled():
            return plain(module, *args, **kwargs)
        if index == 0:
            self.region = CheckpointRegion(functools.partial(self._recompute, **kwargs), self.store, args)
            self.region.enter()
        elif self.region is None:  # a block called on its own, outside the model's loop: nothing to checkpoint
            return plain(module, *args, **kwargs)
        try:
            out = plain(module, *args, **kwargs)
        except BaseException:
            self._close()
            raise
        if index == len(self.modules) - 1:
            self._close()
        return out

    def _close(self) -> None:
        if self.region is not None:
            self.region.exit()
            self.region = None

    def _recompute(self, x: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
        # Through each module's own call, so its hooks run (FSDP gathers the block's parameters again).
        self.recomputing = True
        try:
            for module in self.modules:
                x = module(x, *rest, **kwargs)
        finally:
            self.recomputing = False
        return x


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = model.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def _install(modules: list[nn.Module], store: InputStore) -> None:
    segment = _Segment(modules, store)
    for i, module in enumerate(modules):
        module.forward = functools.partial(segment.call, i, module)
        module._remat = True


def apply_remat(
    model: nn.Module, mode: RematMode = "block", k: int | None = None, store: InputStore | None = None
) -> int:
    """Re-materialise ``model`` (a Transformer or pipeline stage, blocks in ``model.layers``) in ``mode``; ``k``:
    blocks per segment for ``every-k`` (default round(√L) of this model's L blocks); ``store``: how regions keep
    their input (default whole). Returns the number of checkpointed regions (per micro-batch forward)."""
    store = store or WholeInput()
    blocks = _blocks(model)
    if any(getattr(m, "_remat", False) for m in [model, *blocks]):
        raise ValueError("this model is already re-materialised; apply_remat once")
    if mode == "none":
        return 0
    if mode == "stage":
        _install([model], store)
        # The pipeline schedule keeps each received input only for its gradient; with a copying store it may free it.
        model.remat_input_copied = store.copies_input
        return 1
    if mode == "block":
        k = 1
    elif mode == "every-k":
        k = k or default_segment_size(len(blocks))
    else:
        raise ValueError(f"unknown re-materialisation mode {mode!r}; choose one of {', '.join(REMAT_MODES)}")
    ranges = segment_ranges(len(blocks), k)
    for r in ranges:
        _install([blocks[i] for i in r], store)
    return len(ranges)


class SavedBytes:
    """Bytes autograd holds for backward while active: every tensor saved inside the ``with`` block (saved by an op or
    a custom Function), counted once per storage, parameters (and any ``exclude`` tensors) left out.

    Inside a re-materialised region the region's own hook takes over, so what is counted is exactly what the
    checkpoints keep — the regions' inputs — plus everything saved outside regions.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}  # data pointer -> bytes
        self.devices: dict[int, str] = {}  # data pointer -> device type
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def bytes_on(self, device_type: str) -> int:
        """The part of :attr:`nbytes` held in memory of ``device_type`` ("cpu", "cuda")."""
        return sum(n for ptr, n in self.storages.items() if self.devices[ptr] == device_type)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
            self.devices[storage.data_ptr()] = t.device.type
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
