"""SFT on the parallel trainer, for runs that ``torchrun`` starts with more than one process:

    torchrun --nproc-per-node 2 -m spinwheel.cli sft --dp 2 ...        # or --zero 3, --fsdp, --tp 2, --pp 2, ...

:func:`~spinwheel.train.sft.train_sft` dispatches here; the loop is :func:`~spinwheel.train.sft.run_sft`, the same
as in one process, stepping a :class:`ParallelLearner` instead of the single-process learner. So the data order and
the global batch are the single-process ones (every rank builds the step's batch and the trainer gives each rank
its slice), and the per-step losses equal single-process training's.

* **Step**: AdamW with the SFT recipe — the learning-rate schedule through ``ParallelTrainer.set_lr``, decoupled
  weight decay on weight matrices only and clipping by the global gradient norm (both applied by the trainer across
  shards; see :mod:`spinwheel.parallel.optim`). ``collate`` gives ``input_ids`` (B, T) and a ``loss_mask`` (B, T−1)
  for the next tokens; the trainer takes inputs and labels already shifted.
* **Logging** (``metrics.jsonl``, curves, the progress bar): rank 0 only; losses and gradient norms are global.
* **Evaluation**: on rank 0, with a full copy of the model into which the consolidated weights are loaded before each
  evaluation; the other ranks wait in their next collective, so ``--timeout-s`` must exceed one evaluation.
* **Checkpoints**: ``<out_dir>/checkpoint`` holds the consolidated HF model (``save_hf``'s weights), the tokenizer
  and ``trainer_state.pt`` (step, config), written by rank 0, and ``sharded/`` — every rank's parameter and
  optimizer shards (``ParallelTrainer.save``) and its RNG state — all replaced in one atomic rename. Resuming needs
  the same layout; multi-node runs need ``--out-dir`` on a filesystem every node sees. The HF directory loads
  anywhere (``spinwheel.load_model``, transformers), and a single-process run can start from it with ``--model``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.launch import destroy_distributed, init_distributed
from spinwheel.parallel.train import ParallelTrainer
from spinwheel.train.checkpoint import rng_state, save_checkpoint, set_rng_state
from spinwheel.train.optim import ADAMW_BETAS, ADAMW_EPS, decays
from spinwheel.train.sft import SFTConfig, run_sft

SHARDED_DIR = "sharded"


class ParallelLearner:
    """The SFT learner on :class:`~spinwheel.parallel.ParallelTrainer` (one per rank; see the module docstring)."""

    distributed = True

    def __init__(self, config: SFTConfig, model: Transformer) -> None:
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        # Rank 0's evaluation/consolidation model: copied before parallelize cuts and shards ``model``.
        self.eval_model = copy.deepcopy(model) if self.is_main else None
        dims = config.parallel.make_dims()
        m = config.parallel.microbatches
        if config.batch_size % (dims.dp * m):
            raise ValueError(f"--batch-size {config.batch_size} must be divisible by the data-parallel degree × "
                             f"--microbatches = {dims.dp} × {m}; change one of them")

        def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
            # The trainer applies the weight decay (matrices only), as build_adamw's parameter groups do.
            return torch.optim.AdamW(params, lr=config.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0,
                                     foreach=True)

        self.trainer = ParallelTrainer(model, adamw, config.parallel, dims,
                                       max_grad_norm=config.grad_clip if config.grad_clip > 0 else math.inf,
                                       weight_decay=config.weight_decay, decays=decays)

    def load(self, state: dict[str, Any], ckpt_dir: Path) -> None:
        shards = ckpt_dir / SHARDED_DIR
        if not shards.is_dir():
            raise ValueError(f"{ckpt_dir} holds no sharded trainer state (a single-process checkpoint): resume it "
                             "without torchrun, or start over with --no-resume")
        self.trainer.load(str(shards))
        set_rng_state(torch.load(shards / f"rng{self.rank:05d}.pt", map_location="cpu", weights_only=False))

    def train_step(self, batch: dict[str, torch.Tensor], lr: float) -> tuple[float, float]:
        self.trainer.set_lr(lr)
        ids = batch["input_ids"]  # (B, T): position t predicts token t + 1
        loss = self.trainer.step(ids[:, :-1], ids[:, 1:], batch["loss_mask"])
        assert self.trainer.grad_norm is not None
        return loss, self.trainer.grad_norm

    def sync_eval_model(self) -> None:
        """Consolidate the weights into rank 0's full model (collective)."""
        full = self.trainer.full_state_dict()
        if self.eval_model is not None:
            self.eval_model.load_state_dict(full)

    def save(self, ckpt_dir: Path, tokenizer: Tokenizer, state: dict[str, Any]) -> None:
        """Write the checkpoint (collective): rank 0 the HF files and trainer_state.pt, every rank its shards."""
        self.sync_eval_model()
        if self.eval_model is not None:
            save_checkpoint(ckpt_dir, self.eval_model, tokenizer, state, extra=self._save_shards)
        else:
            self._save_shards(None)
        dist.barrier()  # the rename is done before any rank reads or writes the directory again

    def _save_shards(self, tmp: Path | None) -> None:
        where = [str(tmp) if tmp is not None else None]
        dist.broadcast_object_list(where, src=0)  # rank 0's temporary checkpoint directory
        shards = Path(where[0]) / SHARDED_DIR
        shards.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), shards / f"rng{self.rank:05d}.pt")
        self.trainer.save(str(shards))  # ends in a barrier: every shard is written before rank 0 renames


def train_sft_parallel(config: SFTConfig,
                       on_eval: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Join the torchrun world (NCCL for a CUDA --device, gloo otherwise), run the SFT loop on the parallel trainer, and leave the
    world again (if this call joined it)."""
    joined = not dist.is_initialized()
    init_distributed("nccl" if config.device.startswith("cuda") else "gloo", timeout_s=config.parallel.timeout_s)
    try:
        result = run_sft(config, ParallelLearner, on_eval)
        dist.barrier()  # leave together: tearing down groups while a peer still evaluates can abort gloo's threads
        return result
    finally:
        if joined:
            destroy_distributed()
