"""A consolidated Hugging Face checkpoint written tensor by tensor from a sharded layout: no rank ever holds the
whole model (issue 26; :func:`~spinwheel.parallel.checkpoint.full_state_dict` gathers it on every rank instead).

A safetensors file is an 8-byte little-endian header length, a JSON header (every tensor's dtype, shape and byte
range; padded with spaces to a multiple of 8) and the tensors' bytes back to back. The header depends on names,
dtypes and shapes alone, so it is computed before any tensor moves (:func:`safetensors_header`, in the order the
installed safetensors library writes: the file equals ``save_file``'s byte for byte), and each tensor is then
written at its offset as it reaches rank 0:

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
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from spinwheel.models.hf import SAFETENSORS_METADATA, hf_tensor_name, save_config
from spinwheel.models.hf_format import apply_umask
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.flat_param import FlatParamUnit
from spinwheel.parallel.fsdp import FullyShardedDataParallel
from spinwheel.parallel.parallelize import ParallelModel

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
        return _numel(self.shape) * self.dtype.itemsize


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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- the file ------------------------------------------------------------------------------------------------------


def safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, int]]:
    """The bytes before the data of a safetensors file holding ``entries`` (HF name, dtype, shape) with spinwheel's
    metadata, and each tensor's byte offset into the data. The tensor order and dtype names are the installed
    library's: it serialises empty tensors of the same names and dtypes (the order depends on nothing else)."""
    shapes = {name: (dtype, shape) for name, dtype, shape in entries}
    probe = safetensors_bytes({name: torch.empty(0, dtype=dtype) for name, dtype, _ in entries}, SAFETENSORS_METADATA)
    size = int.from_bytes(probe[:8], "little")
    order = json.loads(probe[8 : 8 + size])
    header: dict[str, object] = {"__metadata__": order.pop("__metadata__")}
    offsets, offset = {}, 0
    for name, info in order.items():
        dtype, shape = shapes[name]
        nbytes = _numel(shape) * dtype.itemsize
        header[name] = {"dtype": info["dtype"], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[name], offset = offset, offset + nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


class SafetensorsWriter:
    """``model.safetensors`` for ``entries``, its header written first; :meth:`write` puts each tensor at its offset
    as it arrives (in any order), :meth:`close` checks that every one came."""

    def __init__(self, path: Path, entries: list[Entry], hf_names: dict[str, str]) -> None:
        self.path, self.entries = path, {e.name: e for e in entries}
        prefix, offsets = safetensors_header([(hf_names[e.name], e.dtype, e.shape) for e in entries])
        self.offsets = {e.name: len(prefix) + offsets[hf_names[e.name]] for e in entries}
        self.left = set(self.entries)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, len(prefix) + sum(e.nbytes for e in entries))
        self._pwrite(memoryview(prefix), 0)

    def write(self, name: str, t: torch.Tensor) -> None:
        e = self.entries.get(name)
        if e is None or name not in self.left:
            raise RuntimeError(f"{self.path}: tensor {name!r} is not in the header or came twice")
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise RuntimeError(f"{self.path}: {name} arrived as {tuple(t.shape)} {t.dtype}, the header says {e}")
        if t.numel():
            data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()  # a view: nothing copied
            self._pwrite(memoryview(data), self.offsets[name])
        self.left.discard(name)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        while len(data):  # pwrite may write less than asked (over 2 GiB at once on Linux)
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

    def close(self) -> None:
        os.close(self.fd)
        apply_umask(self.path)
        if self.left:
            raise RuntimeError(f"{self.path}: {len(self.left)} tensors never arrived, e.g. {sorted(self.left)[0]}")


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
        del local, full  # a unit's last view would keep it alive while the generator gathers the next


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


@torch.no_grad()
def stream_safetensors(pm: ParallelModel, file: str | os.PathLike | None) -> SaveStats:
    """Write the parallel model's full weights to the safetensors ``file`` on rank 0 without gathering them anywhere
    (collective: every rank calls it; ``file`` is read on rank 0 alone)."""
    start = time.perf_counter()
    dims, comm, peak = pm.dims, pm.dims.comm, _Peak()
    mine = local_entries(pm)
    stages: list[list[Entry]] = comm.all_gather_object(mine, dims.pp_axis)  # type: ignore[assignment]
    _check_entries(pm, stages)
    model_bytes = sum(e.nbytes for stage in stages for e in stage)
    if dims.rank == 0:
        if file is None:
            raise ValueError("stream_safetensors: rank 0 needs the file to write")
        config = pm.stage.config
        entries = [e for stage in stages for e in stage]
        writer = SafetensorsWriter(Path(file), entries, {e.name: hf_tensor_name(e.name, config) for e in entries})
        try:
            _run_stage(pm, mine, writer.write, peak)
            for s in range(1, dims.pp):
                for e in stages[s]:
                    buf = peak.hold(torch.empty(e.shape, dtype=e.dtype))
                    comm.recv(buf, dims.pp_axis, s)
                    writer.write(e.name, buf)
                    peak.drop(buf)
                    del buf
        finally:
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
    file = None
    if pm.dims.rank == 0:
        assert path is not None, "rank 0 writes the checkpoint: it needs its path"
        config = copy.copy(pm.stage.config)
        embedding = next(e for e in local_entries(pm) if e.name == "embed_tokens.weight")  # stage 0 holds it
        config.torch_dtype = str(embedding.dtype).removeprefix("torch.")  # the model's dtype, as save_pretrained
        save_config(config, path, tokenizer)
        file = Path(path) / MODEL_FILE
    return stream_safetensors(pm, file)
