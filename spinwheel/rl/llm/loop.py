"""The LLM policy-gradient run: each step, prompts → the engine samples G completions each from the trainer's
*current* weights → rewards → old (and reference) log-probs from the trainer's forward → the algorithm's
advantages → its update → the new weights reach the engine (:meth:`RLJob.step`). The harness
(:mod:`spinwheel.train.run`) does the rest: resume, logging, cadence, interrupts, checkpoints.

One process: the engine serves the learner's own model object (no copy; ``update_weights`` after each update).
Under ``torchrun``: every data-parallel rank samples its share of the prompts with its own engine; where the layout
shards parameters (ZeRO-3 / FSDP, TP, PP) each rank gathers the full weights into its engine copy after each update
(the time is logged as ``time/sync``, the copy's size as ``engine_copy_mb``). Ratios are exact: old-policy log-probs
come from the trainer's forward, and the engine's own log-probs only measure the sampler/trainer mismatch
(``mismatch_max`` / ``mismatch_mean``), optionally corrected by truncated importance sampling (``--tis-cap``).
With one update per rollout in one process the old policy *is* the policy being trained: its log-probs are the
update's own forward, detached, and no separate old-policy forward runs (:func:`reuses_update_logprobs`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from spinwheel.models.hf import load_model
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.parallel.comm import metrics_since
from spinwheel.rl.llm.algorithms import ALGORITHMS, Algorithm, Parts
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.episode_tokens import episode_batch, episode_metrics, episode_rewards, mean_info
from spinwheel.rl.llm.off_policy import off_policy_weights, staleness_figures, token_versions
from spinwheel.rl.llm.rollouts.engine_tp import check_engine_tp
from spinwheel.rl.llm.rollouts.rollout_factory import make_rollouts, make_source
from spinwheel.rl.llm.rollouts.rollout_play import serve_rollouts
from spinwheel.rl.llm.rollouts.rollout_ranks import Placement, placed
from spinwheel.rl.llm.token_advantages import dynamic_sampling_mask
from spinwheel.rl.llm.token_losses import kl_per_token, logprob_mismatch, token_weights
from spinwheel.train.learners import Learner, LocalLearner, OptimConfig, ParallelLearner, distributed_world
from spinwheel.train.lora_run import AdaptersOff, check_one_process, load_run_model, start_figures
from spinwheel.train.memory import PhasePeaks, release_free_memory
from spinwheel.train.run import Run


def reuses_update_logprobs(config: RLConfig, algo: Algorithm, learner: Learner) -> bool:
    """Whether the old-policy log-probs can be the update's own (detached) instead of a separate forward.

    With one update per rollout in one process the old policy is the current one (ratio exactly 1), so the extra
    no-grad forward is redundant; the loss hands its log-probs back for the mismatch and KL figures. Several updates
    (μ > 1 or minibatches), an algorithm that needs them before the update (a KL in the reward, TRPO's surrogate)
    and parallel layouts (each rank's loss sees only its rows) keep the exact forward.
    """
    return config.updates_per_step == 1 and algo.reuses_update_logprobs and not learner.distributed


def train_rl(config: RLConfig) -> dict[str, Any]:
    """Run the configured algorithm; returns the final figures (``eval_before``, ``eval_after``, ``history``)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    with distributed_world(config.device, config.parallel) as distributed, placed(config, distributed) as place:
        if place is not None and place.is_rollout:  # --rollout-ranks
            return serve_rollouts(config, place)  # this rank only generates (rollout_play.py)
        distributed = distributed and (place is None or place.trainers_distributed)
        dims = config.parallel.make_dims() if place is None else place.trainer_dims()
        config.parallel.check_batch(config.rollout_batch // config.minibatches, dims.dp, what="the minibatch of")
        with Run(config, distributed, config.algo) as run:
            if run.finished():
                return run.finished_result()
            run.announce_resume()
            job = RLJob(config, run, dims if distributed else None, place)
            curves = [
                ("reward_mean", "sampled reward"),
                (job.eval_key, f"held-out {job.eval_label} (greedy)"),
                ("kl_ref" if job.reference is not None else "approx_kl", "KL"),
                ("clip_frac", "clip fraction"),
                ("response_len", "completion tokens"),
            ]
            postfix = lambda r: {"reward": f"{r['reward_mean']:.3f}"}  # noqa: E731
            try:
                result = run.train(job, curves, f"{config.algo} {config.model}", postfix)
            finally:
                job.rollouts.close()
            return {**result, "eval_label": job.eval_label}


class RLJob:
    """The run's parts (policy learner, reference, algorithm, engine, prompts, reward) and its step."""

    def __init__(self, config: RLConfig, run: Run, dims, placement: Placement | None = None) -> None:
        self.config, self.run, self.dims, self.placement = config, run, dims, placement
        self.tokenizer = tokenizer = load_tokenizer(run.ckpt_dir if run.resumed else config.model)
        self.pad_id = tokenizer.pad_id or 0
        load = dict(dtype=config.dtype, device=config.device, seed=config.seed, vocab_size=tokenizer.vocab_size)
        load["lazy"] = dims is not None  # the learners' models under torchrun: read as they are sharded (lazy_load)
        check_one_process(config, dims is not None, config.algo)
        self.engine_tp_size = check_engine_tp(config, dims)  # --engine-tp N: engine_tp.py
        if config.max_staleness is not None and dims is not None and placement is None:
            raise ValueError("--max-staleness under torchrun needs --rollout-ranks R (generation on ranks of its own)")
        policy = load_run_model(config, run, **load)  # with --lora-rank: the base under adapters
        optim = OptimConfig(config.lr, config.weight_decay, config.grad_clip, fused=True)
        self.learner = self.make_learner(policy, optim)
        resume_step = run.start_step if run.resumed else None
        parts = Parts(
            lambda: load_model(config.model, **load), self.make_learner, run.out_dir, resume_step, load["lazy"]
        )
        self.algo = ALGORITHMS[config.algo](config, parts)
        self.reference = None
        if self.algo.needs_reference:  # with LoRA: the policy with its adapters off, no second copy (lora_run)
            ref = AdaptersOff(self.learner, policy) if config.lora_rank else None
            self.reference = ref or self.make_learner(load_model(config.model, **load), None)
        if run.state is not None:
            self.learner.load(run.ckpt_dir, run.state)
        say = print if run.is_main else (lambda line: None)
        context = policy.config.max_position_embeddings
        self.source, builtin = make_source(config, tokenizer, context, say, dims, run.stop_requested)
        self.num_train, self.num_eval = self.source.num_train, self.source.num_eval  # None: procedural episodes
        self.eval_key = "eval_exact_match" if builtin else "eval_reward"  # the built-in reward is exact match
        self.eval_label = "exact match" if builtin else "mean reward"
        options = dataclasses.asdict(config.engine)
        options.update(max_model_len=self.source.max_model_len(context), seed=config.seed)
        first, end = run.start_step, run.end_step
        self.rollouts = make_rollouts(config, self.learner, tokenizer, options, self.source, placement, first, end)
        self.last_step_end: float | None = None
        self.on_policy = reuses_update_logprobs(config, self.algo, self.learner)
        run.open_log(self.learner.is_main)
        if not run.resumed:
            counts = {"num_train": self.num_train, "num_eval": self.num_eval}
            trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
            run.log(
                {"step": 0, "algo": config.algo, **counts, "num_trainable_params": trainable, **start_figures(policy)}
            )

    def make_learner(self, model, optim: OptimConfig | None) -> Learner:
        """A learner on the run's layout (the parallel trainer under torchrun); ``optim=None``: frozen."""
        t = self.config.temperature  # the loss's log-probs are those of the policy that samples at T
        if self.dims is None:
            return LocalLearner(model, optim, temperature=t, micro_batch_tokens=self.config.parallel.micro_batch_tokens)
        full = optim is not None and model.config.num_labels is None  # the policy (the saves: a LoRA one's adapter)
        copy = "all" if full and self.engine_tp_size == 1 else "main" if full and self.config.lora_rank else "none"
        return ParallelLearner(model, optim, self.config.parallel, self.dims, engine_copy=copy, temperature=t)

    def step(self, step: int) -> dict[str, Any]:
        """One rollout step: take the step's episodes (played now, or by the producer) → log-probs → advantages →
        update → the new weights reach the engine (or are published to the producer)."""
        c, algo, learner = self.config, self.algo, self.learner
        start, comm_before, peaks = time.perf_counter(), learner.comm_metrics(), PhasePeaks()
        with peaks.phase("gen"):  # generate + score (with the producer: the wait for its rollouts)
            rollout = self.rollouts.take(step)
        release_free_memory()  # what generation freed (its activations): not resident under the update's peak
        episodes, times, mark = rollout.episodes, rollout.times, time.perf_counter()
        rewards, keep = episode_rewards(episodes, c.group_size)
        batch = {k: v.to(c.device) for k, v in episode_batch(episodes, self.pad_id).items()}
        inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        if not learner.distributed:  # the local learner runs each group's shared prompt once
            inputs.update(prompt_lens=batch["prompt_lens"], completion_lens=batch["completion_lens"])
        with peaks.phase("logprobs"):
            old = None if self.on_policy else learner.forward(inputs)["logprobs"]
            ref = self.reference.forward(inputs)["logprobs"] if self.reference is not None else None
        mask, keep = batch["mask"], keep.to(batch["mask"].device)
        if c.dynamic_sampling:  # DAPO: groups whose rewards are all equal carry no signal
            keep = keep * dynamic_sampling_mask(rewards, c.group_size).float().to(mask.device)
        stale, fresh, figures = self.staleness(episodes, mask, step)
        keep = keep if fresh is None else keep * fresh  # rollouts more than K updates old are dropped
        times["logprobs"], mark = time.perf_counter() - mark, time.perf_counter()
        advantages = algo.prepare(rewards.to(mask.device), mask, inputs, old, ref, batch["turn_rewards"])
        per_row = {**inputs, "mask": mask * keep[:, None], **advantages, **self.logprob_rows(old, ref, batch, stale)}
        own: list[torch.Tensor] | None = [] if old is None else None  # the update's own log-probs stand in
        with peaks.phase("update"):
            stats = algo.update(learner, per_row, step, own)
        release_free_memory()  # and the update's, not carried into the next generation
        old = old if own is None else torch.cat(own)  # the update's own forward: the rollout policy's
        times["update"], mark = time.perf_counter() - mark, time.perf_counter()
        self.rollouts.publish(step + 1, learner.engine_model)
        times["sync"] = time.perf_counter() - mark
        record = self.record(rewards, mask, keep, old, ref, batch["engine_logprobs"], stats, times)
        record.update(**figures, **episode_metrics(episodes), **self.source.figures(episodes))
        record.update(**self.overlap(start, times), **peaks.figures())
        record.update(self.rollouts.figures())  # weight sync / broadcast, engine swaps (rollouts.py)
        return {**record, **metrics_since(learner.comm_metrics(), comm_before)}  # log-probs, updates, weight sync

    def staleness(self, episodes, mask, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """(stale tokens (B, T): sampled by older weights than the trainer's; rows to keep (B,); the staleness
        figures) with ``--max-staleness``, else (None, None, {})."""
        if self.config.max_staleness is None:
            return None, None, {}
        versions = token_versions(episodes, mask.shape[1], step).to(mask.device)
        fresh, figures = staleness_figures(versions, mask, step, self.config.max_staleness)
        return ((versions < step) & (mask != 0)).to(mask.dtype), fresh, figures

    def overlap(self, start: float, times: dict[str, float]) -> dict[str, float]:
        """With the producer: the step's wall time (since the last step ended), the trainer's own time, and
        ``overlap``: (generate + score + train) / wall — 1 when nothing overlaps."""
        end, last, self.last_step_end = time.perf_counter(), self.last_step_end, time.perf_counter()
        if "wait_rollout" not in times:
            return {}
        wall, train = end - (last if last is not None else start), end - start - times["wait_rollout"]
        played = times["generate"] + times["score"]
        return {"time/step": wall, "time/train": train, "overlap": (played + train) / max(wall, 1e-9)}

    def logprob_rows(self, old, ref, batch, stale=None) -> dict[str, torch.Tensor]:
        """The per-row log-prob tensors the loss reads besides the algorithm's: reference, old (proximal) policy,
        and the off-policy weights of :func:`~spinwheel.rl.llm.off_policy.off_policy_weights` — or, when the loss
        computes them around its own log-probs, the engine's log-probs and the stale tokens."""
        c, rows, engine_logprobs = self.config, {}, batch["engine_logprobs"]
        if ref is not None:
            rows["ref_logprobs"] = ref
        any_stale = stale is not None and bool(stale.any())
        if old is not None:
            rows["old_logprobs"] = old
            weights = off_policy_weights(old, engine_logprobs, batch["mask"], stale, c.tis_cap, c.mis_cap)
            if weights is not None:
                rows["is_weights"] = weights
        elif c.tis_cap is not None or c.mis_cap is not None or any_stale:
            rows["engine_logprobs"] = engine_logprobs
            if any_stale:
                rows["stale"] = stale
        return rows

    def record(self, rewards, mask, keep, old, ref, engine_logprobs, stats, times) -> dict[str, Any]:
        """The step's figures: rewards, lengths, kept groups, mismatch, the update's stats, KL, phase times."""
        c = self.config
        record = {
            "reward_mean": float(rewards.double().mean()),  # float64: a float32 sum of valid rewards may overflow
            "reward_std": float(rewards.double().std()),
            "response_len": float(mask.sum(1).mean()),
            "kept_groups": float(keep.sum()) / c.group_size,
            **{k: float(v) for k, v in logprob_mismatch(old, engine_logprobs, mask).items()},
            **stats,
        }
        if ref is not None:
            weights = token_weights(mask, "token-mean")
            record["kl_ref"] = float((weights * kl_per_token(old, ref, c.kl_estimator)).sum())
        record.update({f"time/{phase}": seconds for phase, seconds in times.items()})
        record["tokens_per_s"] = float(mask.sum()) / max(sum(times.values()), 1e-9)
        record["engine_copy_mb"] = self.rollouts.engine_copy_mb
        return record

    def evaluate(self, step: int) -> float | None:
        """The held-out mean reward of greedy episodes on the test split (for the built-in task's reward: exact
        match) and the means of the environment's figures, on the main rank (the engine holds the current
        weights)."""
        c = self.config
        num = min(c.eval_examples, self.num_eval) if self.num_eval is not None else c.eval_examples
        episodes = self.rollouts.evaluate(num) if num else None  # the main rank's (engine-TP ranks serve it)
        if episodes is None:
            return None
        episodes = [e for e in episodes if not e.failed]
        value = sum(e.reward for e in episodes) / max(1, len(episodes))
        figures = {f"eval_{k}": v for k, v in mean_info(episodes).items() if f"eval_{k}" != self.eval_key}
        self.run.log({"step": step, self.eval_key: value, **figures})
        return value

    def save(self, ckpt_dir: Path, state: dict[str, Any]) -> None:
        self.algo.save(self.run.out_dir, state)  # first: a policy checkpoint never points at a missing part
        self.learner.save(ckpt_dir, self.tokenizer, state)
