"""Supervised fine-tuning: next-token cross-entropy on completion tokens only.

The loop reads top to bottom: build model, tokenizer and data; for each step, take the step's batch (a pure
function of the seed and the step number, so resuming needs no sampler state), let the learner take one AdamW
step of the token-mean NLL at the scheduled learning rate; log, evaluate held-out exact match with greedy decoding,
and save atomic checkpoints that resume exactly. Rerunning the command resumes from the checkpoint after comparing its
stored options with the new ones (:mod:`~spinwheel.train.resume`); Ctrl-C stops every rank after the same step with
a checkpoint (:mod:`~spinwheel.train.interrupt`).

The parts: :mod:`~spinwheel.train.sft_config` (options), :mod:`~spinwheel.train.sft_data` (examples, batches,
the loss formula), :mod:`~spinwheel.train.evaluation` (held-out greedy evaluation) and
:mod:`~spinwheel.train.learners` (what steps the model: the single-process reference, or the parallel trainer on
every rank when ``torchrun`` started more than one process). The loop is the same in both; under torchrun rank 0
logs, evaluates on the consolidated weights and writes the HF files, every rank writes its shards.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from spinwheel.models.hf import load_model
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.parallel.comm import metrics_since
from spinwheel.parallel.trainer import nll_loss
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.evaluation import Generate, engine_generate, heldout_eval, plain_generate
from spinwheel.train.interrupt import StopOnSignal
from spinwheel.train.learners import (
    Learner,
    LocalLearner,
    OptimConfig,
    ParallelLearner,
    distributed_world,
    is_main_process,
)
from spinwheel.train.metrics import MetricsLogger, plot_curves
from spinwheel.train.optim import lr_at
from spinwheel.train.resume import OBSERVATION_OPTIONS, finished_message, resume_message, resume_point
from spinwheel.train.sft_config import SFTConfig
from spinwheel.train.sft_data import batch_indices, build_data, collate, trainer_batch

OnEval = Callable[[int, dict[str, Any]], None]
# Options that only change what is observed or when: changing them on resume keeps the run exact.
RESUME_HARMLESS = OBSERVATION_OPTIONS | {"max_new_tokens", "eval_engine"}  # SFT generates only to evaluate


def train_sft(config: SFTConfig, on_eval: OnEval | None = None, announce: bool = False) -> dict[str, Any]:
    """Run SFT as configured; returns the final metrics (``eval_before``, ``eval_after``, ``losses``, ...).

    Under ``torchrun`` with more than one process this trains on the parallel trainer (``config.parallel``);
    otherwise in this process, where only a layout of degree 1 fits. ``announce``: the main rank prints what it
    trains on and, at the end, the held-out score and what it wrote (the ``spinwheel sft`` command).
    """
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    with distributed_world(config.device, config.parallel) as distributed:
        dims = config.parallel.make_dims()
        config.parallel.check_batch(config.batch_size, dims.dp)
        optim = OptimConfig(config.lr, config.weight_decay, config.grad_clip)

        def make_learner(model) -> Learner:
            if distributed:
                return ParallelLearner(model, optim, config.parallel, dims, engine_copy="main")
            return LocalLearner(model, optim)

        return run_sft(config, make_learner, on_eval, announce)


def run_sft(
    config: SFTConfig, make_learner: Callable[[Any], Learner], on_eval: OnEval | None = None, announce: bool = False
) -> dict[str, Any]:
    """The SFT loop over the learner ``make_learner(model)`` builds (see :func:`train_sft`)."""
    out_dir = Path(config.out_dir)
    ckpt_dir = out_dir / "checkpoint"
    state = load_trainer_state(ckpt_dir) if config.resume and ckpt_dir.is_dir() else None
    start_step, changes = resume_point(config, state, ckpt_dir, RESUME_HARMLESS) if state is not None else (0, [])
    main = is_main_process()
    if state is not None and start_step == config.steps:
        if main:
            print(finished_message(start_step, config.steps, ckpt_dir), flush=True)
        return {"start_step": start_step, "end_step": start_step, "finished": True, "checkpoint": str(ckpt_dir)}
    tokenizer = load_tokenizer(ckpt_dir if state is not None else config.model)
    torch.manual_seed(config.seed)
    model = load_model(
        ckpt_dir if state is not None else config.model,
        dtype=config.dtype,
        device=config.device,
        seed=config.seed,
        vocab_size=tokenizer.vocab_size,
    )
    num_params = sum(p.numel() for p in set(model.parameters()))
    data = build_data(config, tokenizer)
    if main:
        if announce:
            source = config.data or "the built-in arithmetic task"
            print(
                f"spinwheel sft: {config.model} ({num_params / 1e6:.2f}M parameters) on {source}: "
                f"{len(data.train)} train / {len(data.eval)} held-out examples; {config.steps} steps of "
                f"{config.batch_size}; writing {out_dir}/",
                flush=True,
            )
        if state is not None:
            print(resume_message(start_step, config.steps, ckpt_dir, changes), flush=True)
        if data.num_dropped:
            print(f"dropped {data.num_dropped} examples longer than --max-seq-len {config.max_seq_len}", flush=True)
    learner = make_learner(model)
    if state is not None:
        learner.load(ckpt_dir, state)
    logger = MetricsLogger(out_dir, resume_step=start_step if state is not None else None) if learner.is_main else None

    def log(record: dict[str, Any]) -> None:
        if logger is not None:
            logger.log(record)

    if state is None:
        log(
            {
                "step": 0,
                "num_params": num_params,
                "num_train": len(data.train),
                "num_eval": len(data.eval),
                "num_dropped": data.num_dropped,
            }
        )

    result: dict[str, Any] = {"start_step": start_step}
    generate_fn: Generate | None = None
    if learner.is_main and learner.engine_model is not None and data.eval:
        longest = max(len(e.prompt_ids) for e in data.eval)
        generate_fn = (
            engine_generate(learner.engine_model, tokenizer, longest + config.max_new_tokens + 1)
            if config.eval_engine
            else plain_generate(learner.engine_model, tokenizer)
        )

    def run_eval(step: int) -> dict[str, Any] | None:
        learner.sync_engine_model()  # collective under torchrun: every rank calls it, rank 0 evaluates
        if generate_fn is None:
            return None
        ev = heldout_eval(generate_fn, data, config.eval_examples, config.max_new_tokens)
        log({"step": step, "eval_exact_match": ev["exact_match"]})
        if on_eval is not None:
            on_eval(step, ev)
        return ev

    if start_step == 0 and (ev := run_eval(0)) is not None:
        result["eval_before"] = ev

    def save(step: int) -> None:
        learner.save(ckpt_dir, tokenizer, {"step": step, "config": dataclasses.asdict(config)})

    end_step = config.steps if config.stop_after is None else min(config.steps, start_step + config.stop_after)
    model.train()
    losses: list[float] = []
    bar = tqdm(
        range(start_step, end_step),
        total=config.steps,
        initial=start_step,
        disable=not (config.progress and learner.is_main),
        desc="sft",
        dynamic_ncols=True,
        mininterval=1.0 if sys.stderr.isatty() else 10.0,
    )  # logs (not a terminal) get a line per 10 s
    t0, tokens = time.perf_counter(), 0.0
    with StopOnSignal(learner.distributed) as stop:
        for step in bar:
            batch = collate(
                [data.train[i] for i in batch_indices(step, config.batch_size, len(data.train), config.seed)],
                tokenizer.pad_id or 0,
            )
            batch = {k: v.to(config.device) for k, v in batch.items()}
            lr = lr_at(step, config.lr, config.warmup_steps, config.steps, config.min_lr_ratio)
            comm_before = learner.comm_metrics()
            out = learner.train_step(trainer_batch(batch), nll_loss, lr)
            tokens += float(batch["loss_mask"].sum())
            losses.append(out.loss)
            log(
                {
                    "step": step + 1,
                    "loss": out.loss,
                    "lr": lr,
                    "grad_norm": out.grad_norm,
                    "completion_tokens_per_s": tokens / (time.perf_counter() - t0),
                    **metrics_since(learner.comm_metrics(), comm_before),  # the step's collectives (torchrun)
                }
            )
            bar.set_postfix(loss=f"{out.loss:.4f}", lr=f"{lr:.2e}", refresh=False)  # drawn at mininterval
            done = step + 1
            if done < end_step and (signum := stop.agreed()) is not None:  # every rank stops after this step
                bar.close()
                save(done)
                raise stop.interrupted(signum, done, ckpt_dir, learner.is_main, config.resume)
            if config.eval_every and done % config.eval_every == 0 and done < config.steps:
                if (ev := run_eval(done)) is not None:
                    bar.write(f"step {done}: held-out exact match {ev['exact_match']:.3f}")
            if config.save_every and done % config.save_every == 0 and done < end_step:
                save(done)
    bar.close()
    save(end_step)
    result.update(losses=losses, end_step=end_step, checkpoint=str(ckpt_dir))
    if end_step == config.steps and (ev := run_eval(end_step)) is not None:
        result["eval_after"] = ev
    if logger is not None:
        plot_curves(
            logger.read(),
            out_dir / "curves.png",
            [("loss", "train loss (completion tokens)"), ("eval_exact_match", "held-out exact match")],
            title=f"SFT {config.model}",
        )
    if announce and learner.is_main:
        print(summary(result, data.eval, out_dir), flush=True)
    return result


def summary(result: dict[str, Any], eval_examples: list, out_dir: Path) -> str:
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
    return f"{score}; wrote {result['checkpoint']} (HF format), {out_dir / 'metrics.jsonl'}, {out_dir / 'curves.png'}"
