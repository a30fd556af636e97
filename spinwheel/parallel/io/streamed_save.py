"""A consolidated Hugging Face checkpoint written tensor by tensor from a sharded layout: no rank ever holds the
whole model (issue 26; :func:`~spinwheel.parallel.io.checkpoint.full_state_dict` gathers it on every rank instead).

A safetensors header depends on names, dtypes and shapes alone, so rank 0 writes it before any tensor moves
(:class:`~spinwheel.models.safetensors_file.SafetensorsWriter`; the file equals ``save_file``'s byte for byte) and
each tensor then lands at its offset as it reaches rank 0:

* ZeRO-3 / FSDP / HSDP: one parameter at a time, each shard sends the piece of it that it holds (a view) to
  data-parallel index 0, which writes (or passes on) that tensor and frees it before the next;
* TP: one parameter at a time, its slices are sent to tensor-parallel index 0, which assembles that tensor alone;
* PP: each stage's first rank sends its tensors to rank 0 one at a time, in the order the stage announced;
  rank 0 writes its own stage, then receives the others' stage by stage.

Only data-parallel index 0 takes part (HSDP: replica 0, whose shard group gathers); replicas hold the same weights.
Every transfer is point-to-point into its destination (no collective's staging copy) and waits with the comm's
timeout. :class:`SaveStats` counts the bytes a rank materialised at once beyond its own shards (``save_peak_mb``):
one tensor, plus one TP slice under TP (two tensors under FSDP with TP: the parameter's slice and the whole), on
the rank a tensor is assembled on; nothing elsewhere.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from spinwheel.models.hf import hf_tensor_name, save_config
from spinwheel.models.safetensors_file import SafetensorsWriter
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.data.flat_param import FlatParamUnit
from spinwheel.parallel.data.fsdp import FullyShardedDataParallel
from spinwheel.parallel.parallelize import ParallelModel
from spinwheel.parallel.run_group import run_group

MODEL_FILE = "model.safetensors"


@dataclass(frozen=True)
class Entry:
    """One tensor of the full model: spinwheel's name, its full shape and dtype, and its tensor-parallel split."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int | None = None  # the dim its TP slices are cut along (None: whole on every TP rank)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class SaveStats:
    """One rank's figures for one save: the most bytes it materialised at once beyond its own shards, the full
    model's bytes (what the gathering save holds on every rank) and the save's seconds."""

    peak_bytes: int
    model_bytes: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        return {
            "save_peak_mb": self.peak_bytes / 2**20,
            "save_model_mb": self.model_bytes / 2**20,
            "save_s": self.seconds,
        }


class _Peak:
    """Bytes held at once by the save's temporaries."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        self.now += t.numel() * t.element_size()
        self.peak = max(self.peak, self.now)
        return t

    def drop(self, t: torch.Tensor) -> None:
        self.now -= t.numel() * t.element_size()


# ---- what each rank holds --------------------------------------------------------------------------------------


def _skipped(name: str, pm: ParallelModel) -> bool:
    return hf_tensor_name(name, pm.stage.config) is None  # a tied head (also the last stage's copy of it)


def local_entries(pm: ParallelModel) -> list[Entry]:
    """This rank's stage's tensors in the order :func:`_local_tensors` yields them, with full shapes."""
    tp, dims = pm.dims.tp, pm.tp_shard_dims
    if isinstance(pm.module, FullyShardedDataParallel):
        held = [
            (name, tuple(unit.shapes[i]), unit.shard.dtype) for unit in pm.module.units for name, _, _, i in unit.refs
        ]
    else:
        held = [(n, tuple(p.shape), p.dtype) for n, p in pm.stage.named_parameters(remove_duplicate=False)]
    out = []
    for name, shape, dtype in held:
        if _skipped(name, pm):
            continue
        dim = dims.get(name)
        full = shape if dim is None else (*shape[:dim], shape[dim] * tp, *shape[dim + 1 :])
        out.append(Entry(name, full, dtype, dim))
    return out


def _gather_param(pm: ParallelModel, unit: FlatParamUnit, i: int, start: int, peak: _Peak) -> torch.Tensor | None:
    """Parameter ``i`` of ``unit`` (elements [start, start + size) of its flat vector) on shard index 0, assembled
    from the piece of it each shard holds (None elsewhere): a rank sends a view of its shard, nothing is copied."""
    axis, comm, shard, s = unit.axis, pm.dims.comm, unit.shard.detach(), unit.shard_size
    end = start + unit.sizes[i]
    out = peak.hold(torch.empty(unit.sizes[i], dtype=shard.dtype, device=shard.device)) if axis.rank == 0 else None
    for j in range(axis.size):
        a, b = max(start, j * s), min(end, (j + 1) * s)  # the part of the parameter shard j holds
        if a >= b:
            continue
        if out is not None and j == 0:
            out[a - start : b - start].copy_(shard[a:b])
        elif out is not None:
            comm.recv(out[a - start : b - start], axis, j)
        elif axis.rank == j:
            comm.isend(shard[a - j * s : b - j * s], axis, 0).wait()
    return None if out is None else out.view(unit.shapes[i])


def _local_tensors(pm: ParallelModel, peak: _Peak) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's tensor or TP slice) in :func:`local_entries`' order; under ZeRO-3/FSDP only shard index 0
    yields, one parameter gathered at a time (freed before the next is gathered)."""
    if not isinstance(pm.module, FullyShardedDataParallel):
        for name, p in pm.stage.named_parameters(remove_duplicate=False):
            if not _skipped(name, pm):
                yield name, p.detach()
        return
    for unit in pm.module.units:
        starts = [sum(unit.sizes[:i]) for i in range(len(unit.sizes))]  # where each parameter begins in the flat
        for name, _, _, i in unit.refs:
            if _skipped(name, pm):
                continue
            t = _gather_param(pm, unit, i, starts[i], peak)
            if t is not None:
                yield name, t
                peak.drop(t)
            del t


def _assemble_tp(pm: ParallelModel, entry: Entry, local: torch.Tensor, peak: _Peak) -> torch.Tensor | None:
    """The full tensor on TP index 0 from every TP rank's slice (None elsewhere; its own slice is sent)."""
    axis, comm = pm.dims.tp_axis, pm.dims.comm
    if axis.rank != 0:
        comm.isend(local.contiguous(), axis, 0).wait()
        return None
    full = peak.hold(torch.empty(entry.shape, dtype=local.dtype, device=local.device))
    for j, part in enumerate(full.chunk(axis.size, dim=entry.dim)):
        if j == 0:
            part.copy_(local)
        elif part.is_contiguous():  # dim 0: straight into place
            comm.recv(part, axis, j)
        else:  # dim 1 (row-parallel): one slice's buffer at a time
            buf = peak.hold(torch.empty_like(local))
            comm.recv(buf, axis, j)
            part.copy_(buf)
            peak.drop(buf)
            del buf
    return full


def _run_stage(pm: ParallelModel, entries: list[Entry], sink: Callable[[str, torch.Tensor], None], peak: _Peak) -> None:
    """Every tensor of this rank's stage, assembled on its first rank and handed to ``sink`` there."""
    by_name = {e.name: e for e in entries}
    for name, local in _local_tensors(pm, peak):
        entry = by_name[name]
        full = local if entry.dim is None else _assemble_tp(pm, entry, local, peak)
        if full is not None and pm.dims.tp_axis.rank == 0:
            sink(name, full)
            if full is not local:
                peak.drop(full)
        del local, full  # else they would stay alive while the generator gathers the next


def _check_entries(pm: ParallelModel, stages: list[list[Entry]]) -> None:
    """The stages' tensors together must be the model's: names and shapes (raised alike on every rank)."""
    config = pm.stage.config
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in Transformer(config).state_dict().items() if hf_tensor_name(n, config)}
    got = {e.name: e.shape for stage in stages for e in stage}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or sorted(n for n in got if got[n] != expected[n])
        raise RuntimeError(
            f"the parallel model's tensors do not make up the model (first difference: {wrong[0]}): "
            "a streamed save takes a plain model (no LoRA layers); save a LoRA run's adapters instead"
        )


# ---- the save ------------------------------------------------------------------------------------------------------


def _takes_part(pm: ParallelModel) -> bool:
    """Data-parallel index 0 (under ZeRO-3/FSDP: the first replica's whole shard group)."""
    coords = pm.dims.coords()
    return coords["dp_replicate"] == 0 and (isinstance(pm.module, FullyShardedDataParallel) or coords["dp_shard"] == 0)


def _agree(error: str | None) -> None:
    """Rank 0's ``error`` (None: it can write) raised on every rank before any tensor moves: a checkpoint that
    cannot be written fails in one line at once, not at the peers' timeouts."""
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0, group=run_group())
        error = box[0]
    if error is not None:
        raise OSError(error)


def _open(pm: ParallelModel, file: str | os.PathLike | None, stages: list[list[Entry]], before) -> SafetensorsWriter:
    assert file is not None, "rank 0 writes the file: it needs its path"
    if before is not None:
        before()
    config = pm.stage.config
    tensors = {hf_tensor_name(e.name, config): (e.dtype, e.shape) for stage in stages for e in stage}
    return SafetensorsWriter(Path(file), tensors)  # type: ignore[arg-type]


@torch.no_grad()
def stream_safetensors(
    pm: ParallelModel, file: str | os.PathLike | None, before: Callable[[], None] | None = None
) -> SaveStats:
    """Write the parallel model's full weights to the safetensors ``file`` on rank 0 without gathering them anywhere
    (collective: every rank calls it; ``file`` is read on rank 0 alone, after ``before()``, e.g. the config)."""
    start = time.perf_counter()
    dims, comm, peak = pm.dims, pm.dims.comm, _Peak()
    mine = local_entries(pm)
    stages: list[list[Entry]] = comm.all_gather_object(mine, dims.pp_axis)  # type: ignore[assignment]
    _check_entries(pm, stages)
    model_bytes = sum(e.nbytes for stage in stages for e in stage)
    writer, error = None, None
    if dims.rank == 0:
        try:
            writer = _open(pm, file, stages, before)
        except OSError as e:
            error = f"cannot write the checkpoint: {e}"
    _agree(error)
    if writer is not None:
        device = next(pm.module.parameters()).device  # where the backend receives (NCCL: the rank's GPU)

        def write(name: str, t: torch.Tensor) -> None:
            writer.write(hf_tensor_name(name, pm.stage.config), t)  # type: ignore[arg-type]

        try:
            _run_stage(pm, mine, write, peak)
            for s in range(1, dims.pp):
                for e in stages[s]:
                    buf = peak.hold(torch.empty(e.shape, dtype=e.dtype, device=device))
                    comm.recv(buf, dims.pp_axis, s)
                    write(e.name, buf)
                    peak.drop(buf)
                    del buf
        except BaseException:
            writer.close(check=False)  # the error that stopped the save is the one to see
            raise
        writer.close()
    elif _takes_part(pm):
        first = dims.pp_axis.ranks[0] == 0  # its stage's first rank: in rank 0's pipeline group

        def send(name: str, t: torch.Tensor) -> None:
            if first:
                comm.isend(t.contiguous(), dims.pp_axis, 0).wait()

        _run_stage(pm, mine, send, peak)
    return SaveStats(peak.peak, model_bytes, time.perf_counter() - start)


def save_streamed(pm: ParallelModel, path: str | os.PathLike | None, tokenizer=None) -> SaveStats:
    """A full HF checkpoint directory (``config.json``, ``generation_config.json``, tokenizer, ``model.safetensors``)
    at ``path`` from the parallel model (collective; rank 0 writes and is the only rank that needs ``path``)."""
    if pm.dims.rank != 0:
        return stream_safetensors(pm, None)
    assert path is not None, "rank 0 writes the checkpoint: it needs its path"
    config = copy.copy(pm.stage.config)
    embedding = next(e for e in local_entries(pm) if e.name == "embed_tokens.weight")  # stage 0 holds it
    config.torch_dtype = str(embedding.dtype).removeprefix("torch.")  # the model's dtype, as save_pretrained's
    return stream_safetensors(pm, Path(path) / MODEL_FILE, before=lambda: save_config(config, path, tokenizer))
