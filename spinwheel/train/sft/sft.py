"""Supervised fine-tuning: next-token cross-entropy on completion tokens only.

The loop reads top to bottom: build model, tokenizer and data; for each step, take the step's batch (a pure
function of the seed and the step number, so resuming needs no sampler state), let the learner take one AdamW
step of the token-mean NLL at the scheduled learning rate; log, evaluate held-out exact match with greedy decoding,
and save atomic checkpoints that resume exactly. Rerunning the command resumes from the checkpoint after comparing its
stored options with the new ones (:mod:`~spinwheel.train.resume`); Ctrl-C stops every rank after the same step with
a checkpoint (:mod:`~spinwheel.train.interrupt`).

The parts: :mod:`~spinwheel.train.sft.sft_config` (options), :mod:`~spinwheel.train.sft.sft_data` (examples, batches,
the loss formula), :mod:`~spinwheel.train.evaluation` (held-out greedy evaluation) and
:mod:`~spinwheel.train.learners` (what steps the model: the single-process reference, or the parallel trainer on
every rank when ``torchrun`` started more than one process). The loop is the same in both; under torchrun rank 0
logs, evaluates on the consolidated weights and writes the HF files, every rank writes its shards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.comm import metrics_since
from spinwheel.parallel.trainer import nll_loss
from spinwheel.train.evaluation import Generate, engine_generate, heldout_eval, plain_generate
from spinwheel.train.learners import (
    Learner,
    LocalLearner,
    OptimConfig,
    ParallelLearner,
    distributed_world,
)
from spinwheel.train.lora_run import check_one_process, load_run_model
from spinwheel.train.optim import lr_at
from spinwheel.train.resume import OBSERVATION_OPTIONS
from spinwheel.train.run import Run
from spinwheel.train.sft.sft_config import SFTConfig
from spinwheel.train.sft.sft_data import batch_indices, build_data, collate, trainer_batch

OnEval = Callable[[int, dict[str, Any]], None]
# Options that only change what is observed or when: changing them on resume keeps the run exact.
RESUME_HARMLESS = OBSERVATION_OPTIONS | {"max_new_tokens", "eval_engine"}  # SFT generates only to evaluate


def train_sft(
    config: SFTConfig,
    on_eval: OnEval | None = None,
    announce: bool = False,
    until: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """Run SFT as configured; returns the final metrics (``eval_before``, ``eval_after``, ``losses``, ...).

    Under ``torchrun`` with more than one process this trains on the parallel trainer (``config.parallel``);
    otherwise in this process, where only a layout of degree 1 fits. ``announce``: the main rank prints what it
    trains on and, at the end, the held-out score and what it wrote (the ``spinwheel sft`` command).
    """
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    with distributed_world(config.device, config.parallel) as distributed:
        check_one_process(config, distributed, "sft")
        dims = config.parallel.make_dims()
        config.parallel.check_batch(config.batch_size, dims.dp)
        optim = OptimConfig(config.lr, config.weight_decay, config.grad_clip)

        def make_learner(model) -> Learner:
            if distributed:
                return ParallelLearner(model, optim, config.parallel, dims, engine_copy="main")
            return LocalLearner(model, optim)

        return run_sft(config, make_learner, on_eval, announce, until)


def run_sft(
    config: SFTConfig,
    make_learner: Callable[[Any], Learner],
    on_eval: OnEval | None = None,
    announce: bool = False,
    until: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """The SFT run over the learner ``make_learner(model)`` builds (see :func:`train_sft`), on the harness;
    ``until``: a test of a periodic evaluation's figures that ends the run there (:meth:`Run.train`)."""
    from spinwheel.parallel.launch import launched_world_size

    with Run(config, launched_world_size() > 1, "sft", RESUME_HARMLESS) as run:
        if run.finished():
            return run.finished_result()
        job = SFTJob(config, run, make_learner, on_eval, announce)
        result = run.train(
            job,
            [("loss", "train loss (completion tokens)"), ("eval_exact_match", "held-out exact match")],
            f"SFT {config.model}",
            lambda r: {"loss": f"{r['loss']:.4f}", "lr": f"{r['lr']:.2e}"},
            until,
        )
        result["losses"] = [r["loss"] for r in result["history"]]
        if announce and job.learner.is_main:
            written = "PEFT adapter" if config.lora_rank else "HF format"
            print(summary(result, job.data.eval, run.out_dir, written), flush=True)
        return result


def load_sft_model(config: SFTConfig, run: Run, vocab_size: int) -> Transformer:
    """The model SFT starts from: ``--model``, or the checkpoint it resumes from; with ``--lora-rank`` the base
    ``--model`` names under fresh adapters or the checkpoint's (:func:`~spinwheel.train.lora_run.load_run_model`)."""
    torch.manual_seed(config.seed)
    load = dict(dtype=config.dtype, device=config.device, seed=config.seed, vocab_size=vocab_size)
    return load_run_model(config, run, **load, lazy=run.distributed)  # torchrun: read as it is sharded


class SFTJob:
    """One SFT step: the step's batch (a pure function of seed and step), one optimizer step of the token-mean
    NLL of the completion tokens at the scheduled learning rate."""

    def __init__(
        self, config: SFTConfig, run: Run, make_learner: Callable[[Any], Learner], on_eval: OnEval | None, announce
    ) -> None:
        self.config, self.run, self.on_eval = config, run, on_eval
        self.tokenizer = load_tokenizer(run.ckpt_dir if run.resumed else config.model)
        model = load_sft_model(config, run, self.tokenizer.vocab_size)
        num_params = sum(p.numel() for p in set(model.parameters()))
        num_trainable = sum(p.numel() for p in set(model.parameters()) if p.requires_grad)
        self.data = data = build_data(config, self.tokenizer, max_context=model.config.max_position_embeddings)
        if run.is_main:
            if announce:
                lora = f", LoRA r={config.lora_rank}: {num_trainable / 1e6:.3f}M trained" if config.lora_rank else ""
                print(
                    f"spinwheel sft: {config.model} ({num_params / 1e6:.2f}M parameters{lora}) on "
                    f"{config.data or 'the built-in arithmetic task'}: {len(data.train)} train / {len(data.eval)} "
                    f"held-out examples; {config.steps} steps of {config.batch_size}; writing {run.out_dir}/",
                    flush=True,
                )
            run.announce_resume()
            if data.num_dropped:
                print(data.dropped_message, flush=True)
        self.learner = make_learner(model)
        if run.state is not None:
            self.learner.load(run.ckpt_dir, run.state)
        run.open_log(self.learner.is_main)
        if not run.resumed:
            run.log(
                dict(step=0, num_params=num_params, num_trainable_params=num_trainable, num_train=len(data.train),
                     num_eval=len(data.eval), num_dropped=data.num_dropped)
            )  # fmt: skip
        self.generate_fn = self._generate_fn()
        model.train()
        self.t0, self.tokens = time.perf_counter(), 0.0

    def _generate_fn(self) -> Generate | None:
        config, learner, data = self.config, self.learner, self.data
        if not (learner.is_main and learner.engine_model is not None and data.eval):
            return None
        longest = max(len(e.prompt_ids) for e in data.eval)
        if config.eval_engine:
            return engine_generate(learner.engine_model, self.tokenizer, longest + config.max_new_tokens + 1)
        return plain_generate(learner.engine_model, self.tokenizer)

    def step(self, step: int) -> dict[str, Any]:
        config, learner = self.config, self.learner
        rows = batch_indices(step, config.batch_size, len(self.data.train), config.seed)
        batch = collate([self.data.train[i] for i in rows], self.tokenizer.pad_id or 0)
        batch = {k: v.to(config.device) for k, v in batch.items()}
        lr = lr_at(step, config.lr, config.warmup_steps, config.steps, config.min_lr_ratio)
        comm_before = learner.comm_metrics()
        out = learner.train_step(trainer_batch(batch), nll_loss, lr)
        self.tokens += float(batch["loss_mask"].sum())
        return {
            "loss": out.loss,
            "lr": lr,
            "grad_norm": out.grad_norm,
            "completion_tokens_per_s": self.tokens / (time.perf_counter() - self.t0),
            **metrics_since(learner.comm_metrics(), comm_before),  # the step's collectives (torchrun)
        }

    def evaluate(self, step: int) -> dict[str, Any] | None:
        self.learner.sync_engine_model()  # collective under torchrun: every rank calls it, rank 0 evaluates
        if self.generate_fn is None:
            return None
        ev = heldout_eval(self.generate_fn, self.data, self.config.eval_examples, self.config.max_new_tokens)
        self.run.log({"step": step, "eval_exact_match": ev["exact_match"]})
        if self.on_eval is not None:
            self.on_eval(step, ev)
        return ev

    def save(self, ckpt_dir: Path, state: dict[str, Any]) -> None:
        self.learner.save(ckpt_dir, self.tokenizer, state)


def summary(result: dict[str, Any], eval_examples: list, out_dir: Path, written: str = "HF format") -> str:
    """The command's closing line: the held-out score (before -> after) and what was written."""
    if not eval_examples:
        score = "no held-out examples to score"
    elif "eval_after" in result:
        before = result.get("eval_before", {}).get("exact_match")
        score = (
            "held-out exact match: "
            + (f"{before:.1%} -> " if before is not None else "")
            + f"{result['eval_after']['exact_match']:.1%}"
        )
    else:
        score = f"stopped at step {result['end_step']} (--stop-after); rerun the same command to continue"
    return f"{score}; wrote {result['checkpoint']} ({written}), {out_dir / 'metrics.jsonl'}, {out_dir / 'curves.png'}"
