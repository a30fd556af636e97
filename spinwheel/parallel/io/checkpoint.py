"""Sharded training checkpoints, and consolidation into a full Hugging Face checkpoint.

``save_sharded`` writes one file per rank (``rank00000.pt`` …): that rank's own parameters — flat shards under
FSDP/ZeRO-3, tensor-parallel slices, its pipeline stage — its optimizer state and the layout, plus ``layout.json``.
``load_sharded`` restores them on the same layout (a different layout is refused with a message saying which).

``full_state_dict`` undoes the layout collectively: FSDP units are all-gathered, tensor-parallel slices concatenated
along their split dim, pipeline stages exchanged; every rank gets every parameter under its original name.
``save_hf`` writes the full HF checkpoint from rank 0 without that: tensor by tensor, each gathered to rank 0 alone
(:mod:`~spinwheel.parallel.io.streamed_save`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from spinwheel.parallel.data.fsdp import FullyShardedDataParallel
from spinwheel.parallel.data.zero import ZeroDataParallel
from spinwheel.parallel.io.streamed_save import SaveStats, save_streamed
from spinwheel.parallel.parallelize import ParallelModel
from spinwheel.parallel.run_group import run_group


def _layout(pm: ParallelModel) -> dict:
    d = pm.dims
    return {
        "world_size": d.world_size,
        "dp_replicate": d.dp_replicate,
        "dp_shard": d.dp_shard,
        "tp": d.tp,
        "pp": d.pp,
        "dp_kind": pm.dp_kind,
    }


def _barrier(pm: ParallelModel) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier(group=run_group())


def _frozen_names(module: torch.nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _trained_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict without frozen parameters: a LoRA run's shards hold the adapters, not the base
    (which the run loads again from ``--model``)."""
    frozen = _frozen_names(module)
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def save_sharded(trainer, path: str | os.PathLike) -> None:
    """Write this rank's training state to ``path/rankNNNNN.pt`` (collective: every rank calls it)."""
    pm = trainer.pm
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        "layout": _layout(pm),
        "model": _trained_state(pm.module),
        "optimizer": trainer.optimizer.state_dict(),
        "num_steps": trainer.num_steps,
    }
    if isinstance(pm.module, ZeroDataParallel):  # mixed precision keeps separate fp32 masters
        state["masters"] = [bk.master.detach() for bk in pm.module.buckets]
    torch.save(state, out / f"rank{pm.dims.rank:05d}.pt")
    if pm.dims.rank == 0:
        (out / "layout.json").write_text(json.dumps(_layout(pm), indent=2) + "\n")
    _barrier(pm)


def load_sharded(trainer, path: str | os.PathLike) -> None:
    """Restore what :func:`save_sharded` wrote, on the same layout."""
    pm = trainer.pm
    file = Path(path) / f"rank{pm.dims.rank:05d}.pt"
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: no shard for rank {pm.dims.rank}; was the checkpoint saved with {pm.dims.world_size} processes?"
        )
    state = torch.load(file, map_location="cpu", weights_only=False)
    if state["layout"] != _layout(pm):
        raise ValueError(
            f"{path}: saved with layout {state['layout']}, but this run is {_layout(pm)}; resume "
            "with the same degrees, or start a new run from the HF files saved beside it (`--model <checkpoint dir> "
            "--no-resume`: the weights carry over, the optimizer state starts afresh)"
        )
    missing, unexpected = pm.module.load_state_dict(state["model"], strict=False)
    lacking = sorted(set(missing) - _frozen_names(pm.module))  # frozen parameters come from --model
    if unexpected or lacking:
        raise ValueError(
            f"{path}: its shards do not match this model (missing {lacking}, unexpected {sorted(unexpected)}): "
            "resume with the same model and --lora-* options"
        )
    if "masters" in state:
        with torch.no_grad():
            for bk, master in zip(pm.module.buckets, state["masters"]):
                bk.master.copy_(master)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.num_steps = state["num_steps"]


def full_state_dict(pm: ParallelModel, trained_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of the original model, unsharded, by its original name (collective over all ranks);
    ``trained_only``: the parameters that train alone (a LoRA model's adapters: the frozen base is not gathered)."""
    dims, comm = pm.dims, pm.dims.comm
    if isinstance(pm.module, FullyShardedDataParallel):
        local = pm.module.full_state()
    else:
        named = pm.stage.named_parameters(remove_duplicate=False)
        local = {n: p.detach().clone() for n, p in named if p.requires_grad or not trained_only}
    for name, dim in pm.tp_shard_dims.items():
        if name in local:
            local[name] = torch.cat(comm.all_gather_list(local[name].contiguous(), dims.tp_axis), dim=dim)
    full: dict[str, torch.Tensor] = {}
    for part in comm.all_gather_object(local, dims.pp_axis):
        full.update(part)
    config = pm.stage.config
    if config.tie_word_embeddings and "embed_tokens.weight" in full:
        full["lm_head.weight"] = full["embed_tokens.weight"]
    return full


def save_hf(pm: ParallelModel, path: str | os.PathLike) -> SaveStats:
    """Consolidate the parallel model into a full HF checkpoint at ``path`` (collective; rank 0 writes), tensor by
    tensor: no rank holds the full model (:mod:`~spinwheel.parallel.io.streamed_save`). Returns this rank's figures."""
    stats = save_streamed(pm, path if pm.dims.rank == 0 else None)
    _barrier(pm)
    return stats
