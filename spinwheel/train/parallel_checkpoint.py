"""A :class:`~spinwheel.train.learners.ParallelLearner`'s checkpoint (collective: every rank calls
:func:`save_parallel`). Rank 0 writes ``trainer_state.pt`` and the HF files, every rank its sharded trainer state and
RNG state (``sharded/``), all into :func:`~spinwheel.train.checkpoint.save_checkpoint`'s temporary directory, which
replaces the checkpoint by one rename once every rank is done.

The HF files come one of two ways:

* **streamed** (:mod:`~spinwheel.parallel.io.streamed_save`) where no rank holds the full weights — ZeRO-3, FSDP,
  HSDP, TP or PP: ``model.safetensors`` is written tensor by tensor as each is gathered to rank 0 alone, so no rank
  (rank 0 included) ever materialises the whole model; each rank's figures (``save_peak_mb`` beside the model's
  ``save_model_mb``) are logged and returned;
* **gathered** (:func:`save_gathered`): every rank gathers the full state and rank 0 writes it through its engine
  copy. Kept where a full replica exists anyway (DDP / ZeRO-1/2 without TP/PP: the training weights themselves) and
  for LoRA runs, whose checkpoint holds the adapters alone (small: only they are gathered where the engine copy
  keeps the frozen base).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from spinwheel.models.transformer import Transformer
from spinwheel.parallel.io.streamed_save import save_streamed
from spinwheel.parallel.parallelize import ParallelModel
from spinwheel.parallel.run_group import run_group
from spinwheel.parallel.trainer import ParallelTrainer
from spinwheel.train.checkpoint import rng_state, save_checkpoint

if TYPE_CHECKING:
    from spinwheel.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SHARDED_DIR = "sharded"


class ParallelLearner(Protocol):
    """What a save reads of :class:`~spinwheel.train.learners.ParallelLearner`."""

    trainer: ParallelTrainer
    rank: int
    is_main: bool
    engine_model: Transformer | None
    shares_weights: bool  # the engine copy is the training weights (a full replica)
    frozen_base: bool  # LoRA: the engine copy keeps the frozen base, the adapters alone are gathered


def streams(pm: ParallelModel) -> bool:
    """Whether a checkpoint of ``pm`` is streamed: no rank holds the full weights (ZeRO-3/FSDP/HSDP, TP or PP) and
    every parameter trains (a LoRA model's frozen base: its checkpoint is the adapters)."""
    sharded = pm.dp_kind not in ("ddp", "zero1", "zero2") or pm.dims.tp > 1 or pm.dims.pp > 1
    return sharded and all(p.requires_grad for p in pm.module.parameters())


def save_parallel(
    learner: ParallelLearner, ckpt_dir: Path, tokenizer: Tokenizer | None, state: dict[str, Any]
) -> list[dict[str, float]] | None:
    """Write the checkpoint (collective). Streamed: returns every rank's figures of the save, by rank."""
    pm = learner.trainer.pm
    if not streams(pm):
        save_gathered(learner, ckpt_dir, tokenizer, state)
        return None
    figures: list[dict[str, float]] = []

    def write(tmp: Path | None) -> None:
        tmp = _shared_tmp(tmp)
        figures.append(save_streamed(pm, tmp, tokenizer).metrics())  # rank 0 writes the HF files
        _save_shards(learner, tmp)

    if learner.is_main:
        save_checkpoint(ckpt_dir, None, tokenizer, state, extra=write)
    else:
        write(None)
    dist.barrier(group=run_group())  # the rename is done before any rank reads or writes the directory again
    by_rank: list[Any] = [None] * dist.get_world_size(run_group())
    dist.all_gather_object(by_rank, figures[0], group=run_group())
    if learner.is_main:
        logger.info(
            "checkpoint %s streamed in %.2f s: peak materialised per rank %s MiB of a %.1f MiB model",
            ckpt_dir,
            by_rank[0]["save_s"],
            ", ".join(f"{f['save_peak_mb']:.1f}" for f in by_rank),
            by_rank[0]["save_model_mb"],
        )
    return by_rank


def save_gathered(learner: ParallelLearner, ckpt_dir: Path, tokenizer: Tokenizer | None, state: dict[str, Any]) -> None:
    """The full state gathered on every rank, rank 0 writing it through its engine copy (or a model built for the
    HF files alone where it keeps none); see the module docstring for where this path is kept."""
    full = learner.trainer.full_state_dict(learner.frozen_base)
    if learner.is_main:
        model = learner.engine_model
        model = model if model is not None else Transformer(learner.trainer.model_config)
        if not learner.shares_weights:
            model.load_state_dict(full, strict=not learner.frozen_base)
        save_checkpoint(ckpt_dir, model, tokenizer, state, extra=lambda tmp: _save_shards(learner, _shared_tmp(tmp)))
    else:
        _save_shards(learner, _shared_tmp(None))
    dist.barrier(group=run_group())  # the rename is done before any rank reads or writes the directory again


def _shared_tmp(tmp: Path | None) -> Path:
    """Rank 0's temporary checkpoint directory, on every rank."""
    where = [str(tmp) if tmp is not None else None]
    dist.broadcast_object_list(where, src=0, group=run_group())
    return Path(where[0])


def _save_shards(learner: ParallelLearner, tmp: Path) -> None:
    shards = tmp / SHARDED_DIR
    shards.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), shards / f"rng{learner.rank:05d}.pt")
    learner.trainer.save(str(shards))  # ends in a barrier: every shard is written before rank 0 renames
