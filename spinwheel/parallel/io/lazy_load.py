"""Start-up load without the full model on any rank: a checkpoint read piece by piece as :func:`~spinwheel.parallel.
parallelize.parallelize` cuts, slices and shards it (issue 26).

Under ``torchrun`` the learners' models come from :func:`~spinwheel.models.hf.load_model` with ``lazy=True``: the
:class:`~spinwheel.models.transformer.Transformer` is built on the ``meta`` device (shapes and dtypes, no storage;
the RoPE buffer is real) and carries a :class:`LazyCheckpoint` — where each tensor lives in the safetensors
file(s) (one file or an ``index.json``'s shards). ``parallelize`` materialises it as the layout needs:

* **pipeline stages** see only their own layers, so a stage reads only those (and its embedding or head);
* **tensor parallelism** swaps in the column/row/vocab-parallel layers on the meta device; each sharded parameter
  then reads only its rank's slice (``safe_open(...).get_slice(key)[rows]``, the same split as
  :func:`~spinwheel.parallel.tensor._shard`'s ``chunk``), replicated ones (norms, a row layer's bias, a scalar head)
  whole;
* **ZeRO-3 / FSDP / HSDP**: :class:`~spinwheel.parallel.data.fsdp.FullyShardedDataParallel` builds one unit at a time,
  and each rank reads only the elements of the unit's flat vector that fall in its own shard
  (:meth:`LoadPlan.read_shard`: the rows holding them, in blocks of at most :data:`READ_BLOCK_BYTES`, of the TP
  slice where TP applies) straight into the shard; the gathered buffer is allocated but never touched;
* **DDP / ZeRO-1/2** (without TP or PP) keep a full replica — that is their layout — so the whole stage is read.

Every rank reads the same file, so the data-parallel broadcast of rank 0's weights is skipped for a lazy model.
Tied embeddings read ``embed_tokens.weight`` for the head (a pipeline's last stage gets its own copy, as before).
Built-in presets (random init) and PEFT adapter directories are built whole as in one process (presets are tiny;
``--lora-rank`` runs keep that path too: adapters are drawn on a materialised base).

Bookkeeping: the loader counts the parameter bytes it holds materialised — what it read and the layout keeps (TP
slices, stage layers, FSDP shards) plus the block being read — and records the largest total (``load_peak_mb``)
next to the full model's bytes (``model_mb``), see :func:`load_figures`. The engine copy a learner keeps for
generation (``engine_copy``) is a full model by definition and is read separately (:func:`materialised_copy`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path

import torch
from torch import nn

from spinwheel.models.config import ModelConfig
from spinwheel.models.hf_format import open_safetensors
from spinwheel.models.transformer import Transformer, rope_inv_freq

LAZY_ATTR = "_lazy_checkpoint"
READ_BLOCK_BYTES = 16 * 2**20  # the most an FSDP shard's read holds besides the shard
MB = 2**20


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


class LazyCheckpoint:
    """Where an unmaterialised model's tensors are (HF safetensors under spinwheel's names), the dtype and device
    they are read into, and the bytes held so far (``live``, ``peak``)."""

    def __init__(self, path: str | os.PathLike, files: list[Path], model: nn.Module, dtype, device) -> None:
        from spinwheel.models.hf_format import our_name

        self.path, self.dtype, self.device = str(path), dtype, torch.device(device or "cpu")
        self.tied = bool(model.config.tie_word_embeddings)
        self.where: dict[str, tuple[str, str]] = {}  # our name -> (file, key in the file)
        for f in files:
            with open_safetensors(str(f)) as sf:
                for key in sf.keys():
                    self.where[our_name(key)] = (str(f), key)
        self.model_bytes = _param_bytes(model.parameters())
        self.live = self.peak = 0

    def scalar_head_model(self, lm: Transformer, seed: int, std: float | None) -> Transformer:
        """:func:`~spinwheel.models.transformer.scalar_head_model` of this lazy LM: the body read from the checkpoint
        later, the (1, C) score head drawn now from the same generator (equal to the materialised path's)."""
        config = dataclasses.replace(lm.config, num_labels=1, tie_word_embeddings=False, extra=dict(lm.config.extra))
        with torch.device("meta"):
            model = Transformer(config)
        model = model.to(dtype=lm.dtype)
        model.rotary.inv_freq = lm.rotary.inv_freq.clone()
        gen = torch.Generator().manual_seed(seed)
        std = std if std is not None else 1.0 / math.sqrt(config.hidden_size + 1)
        head = torch.randn(model.lm_head.weight.shape, generator=gen).mul_(std)
        model.lm_head.weight = nn.Parameter(head.to(device=self.device, dtype=lm.dtype))
        other = copy.copy(self)
        other.tied, other.model_bytes, other.live, other.peak = False, _param_bytes(model.parameters()), 0, 0
        setattr(model, LAZY_ATTR, other)
        return model

    # -- reading -----------------------------------------------------------------------------------------------------
    def read(
        self, name: str, dim: int | None = None, parts: int = 1, part: int = 0, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Tensor ``name`` (spinwheel's name) or, along ``dim``, its slice ``part`` of ``parts`` (``chunk``'s split);
        ``rows``: only rows [a, b) of that (dim 0), for an FSDP shard."""
        source = "embed_tokens.weight" if self.tied and name == "lm_head.weight" else name
        if source not in self.where:
            raise KeyError(f"{self.path}: no tensor for parameter '{name}' in the checkpoint")
        file, key = self.where[source]
        with open_safetensors(file) as sf:
            piece = sf.get_slice(key)
            shape = piece.get_shape()
            index = [slice(None)] * len(shape)
            start = 0
            if dim is not None and parts > 1:
                size = math.ceil(shape[dim] / parts)
                start = part * size
                index[dim] = slice(start, min(shape[dim], start + size))
            if rows is not None:
                first = start if dim == 0 else 0
                index[0] = slice(first + rows[0], first + rows[1])
            t = piece[tuple(index)] if index else piece[:]
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def _note(self, nbytes: int, transient: int = 0) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live + transient)

    # -- materialising -----------------------------------------------------------------------------------------------
    def plan(self, module: nn.Module, shard_dims: dict[str, int], tp_size: int, tp_rank: int) -> LoadPlan:
        """What each meta parameter of ``module`` (by object) reads: its name and TP split."""
        entries: dict[int, tuple[str, int | None]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if p.is_meta and id(p) not in entries:
                entries[id(p)] = (name, shard_dims.get(name))
        return LoadPlan(self, entries, tp_size, tp_rank)


class LoadPlan:
    """The reads of one model after its pipeline cut and TP swap (parameters keyed by object)."""

    def __init__(self, source: LazyCheckpoint, entries: dict[int, tuple[str, int | None]], tp_size: int, tp_rank: int):
        self.source, self.entries, self.tp_size, self.tp_rank = source, entries, tp_size, tp_rank

    def read(self, p: torch.Tensor, track: bool = True) -> torch.Tensor:
        name, dim = self.entries[id(p)]
        t = self.source.read(name, dim, self.tp_size, self.tp_rank)
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{self.source.path}: '{name}' reads as {tuple(t.shape)}, the layout expects {p.shape}")
        if track:
            self.source._note(t.numel() * t.element_size())
        return t

    def materialise(self, module: nn.Module, track: bool = True) -> None:
        """Replace every meta parameter of ``module`` by one read from the checkpoint (tied ones stay tied)."""
        done: dict[int, nn.Parameter] = {}
        for mod in module.modules():
            for attr, p in list(mod._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(self.read(p, track), requires_grad=p.requires_grad)
                mod._parameters[attr] = done[id(p)]

    def read_shard(self, params: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flat concatenation of ``params`` (an FSDP unit, zero-padded at the end): this
        rank's shard, read in row blocks of at most :data:`READ_BLOCK_BYTES`, so no parameter is ever held whole
        (nor more than one block of it besides the shard)."""
        shard = torch.zeros(hi - lo, dtype=params[0].dtype, device=self.source.device)  # (s,)
        self.source._note(shard.numel() * shard.element_size())
        offset = 0
        for p in params:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                self._copy_range(p, a - offset, b - offset, shard[a - lo : b - lo])
            offset += p.numel()
        return shard

    def _copy_range(self, p: torch.Tensor, a: int, b: int, out: torch.Tensor) -> None:
        """Elements [a, b) of ``p`` flattened (row-major) into ``out``, reading the rows that hold them block by
        block."""
        if not p.is_meta:  # materialised already (a scalar head drawn at load)
            out.copy_(p.detach().reshape(-1)[a:b])
            return
        name, dim = self.entries[id(p)]
        row = math.prod(p.shape[1:])
        block = max(1, READ_BLOCK_BYTES // (row * p.element_size()))
        for r in range(a // row, -(-b // row), block):
            t = self.source.read(name, dim, self.tp_size, self.tp_rank, rows=(r, min(r + block, p.shape[0])))
            t = t.reshape(-1)
            self.source._note(0, transient=t.numel() * t.element_size())
            x, y = max(a, r * row), min(b, r * row + t.numel())  # the block's elements that fall in [a, b)
            out[x - a : y - a].copy_(t[x - r * row : y - r * row])


def lazy_source(model: nn.Module) -> LazyCheckpoint | None:
    return getattr(model, LAZY_ATTR, None)


def lazy_model(path: str | os.PathLike, files: list[Path], config: ModelConfig, dtype, device) -> Transformer:
    """The model ``config`` describes on the meta device, in ``dtype``, reading its tensors from ``files`` later."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype=dtype)
    model.rotary.inv_freq = rope_inv_freq(config).to(device=device or "cpu", dtype=dtype)
    setattr(model, LAZY_ATTR, LazyCheckpoint(path, files, model, dtype, device))
    return model


def materialised_copy(model: nn.Module) -> nn.Module:
    """A full copy of ``model`` with every weight read (a lazy model's engine copy), untracked: a plain deepcopy
    otherwise."""
    out = copy.deepcopy(model)
    source = lazy_source(model)
    if source is not None:
        source.plan(out, {}, 1, 0).materialise(out, track=False)
        delattr(out, LAZY_ATTR)
    return out


def load_figures(model: nn.Module) -> dict[str, float]:
    """``load_peak_mb`` (the most parameter MiB the lazy load held at once on this rank) and ``model_mb`` (the
    full model's); empty for a model loaded whole."""
    source = lazy_source(model)
    if source is None:
        return {}
    return {"load_peak_mb": source.peak / MB, "model_mb": source.model_bytes / MB}
