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

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.hf import load_model
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.parallel.comm import metrics_since
from spinwheel.rl.llm.algorithms import ALGORITHMS, Algorithm, Parts
from spinwheel.rl.llm.build import load_prompts
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.rewards import RewardError, RewardInterrupted, load_reward_fn, score
from spinwheel.rl.llm.rollout import Rollout, generate_rollout, rollout_batch
from spinwheel.rl.llm.token_advantages import dynamic_sampling_mask
from spinwheel.rl.llm.token_losses import kl_per_token, logprob_mismatch, token_weights, truncated_is_weights
from spinwheel.train.interrupt import any_rank
from spinwheel.train.learners import Learner, LocalLearner, OptimConfig, ParallelLearner, distributed_world
from spinwheel.train.lora_run import AdaptersOff, check_one_process, load_run_model, sync_figures
from spinwheel.train.run import Run, StepFailed
from spinwheel.train.sft_data import batch_indices

PHASES = ("generate", "score", "logprobs", "update", "sync")


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
    with distributed_world(config.device, config.parallel) as distributed:
        dims = config.parallel.make_dims()
        config.parallel.check_batch(config.rollout_batch // config.minibatches, dims.dp, what="the minibatch of")
        with Run(config, distributed, config.algo) as run:
            if run.finished():
                return run.finished_result()
            run.announce_resume()
            job = RLJob(config, run, dims if distributed else None)
            curves = [
                ("reward_mean", "sampled reward"),
                (job.eval_key, f"held-out {job.eval_label} (greedy)"),
                ("kl_ref" if job.reference is not None else "approx_kl", "KL"),
                ("clip_frac", "clip fraction"),
                ("response_len", "completion tokens"),
            ]
            postfix = lambda r: {"reward": f"{r['reward_mean']:.3f}"}  # noqa: E731
            result = run.train(job, curves, f"{config.algo} {config.model}", postfix)
            return {**result, "eval_label": job.eval_label}


class RLJob:
    """The run's parts (policy learner, reference, algorithm, engine, prompts, reward) and its step."""

    def __init__(self, config: RLConfig, run: Run, dims) -> None:
        self.config, self.run, self.dims = config, run, dims
        self.tokenizer = tokenizer = load_tokenizer(run.ckpt_dir if run.resumed else config.model)
        self.pad_id = tokenizer.pad_id or 0
        load = dict(dtype=config.dtype, device=config.device, seed=config.seed, vocab_size=tokenizer.vocab_size)
        check_one_process(config, dims is not None, config.algo)
        policy = load_run_model(config, run, **load)  # with --lora-rank: the base under adapters
        optim = OptimConfig(config.lr, config.weight_decay, config.grad_clip, fused=True)
        self.learner = self.make_learner(policy, optim)
        resume_step = run.start_step if run.resumed else None
        parts = Parts(lambda: load_model(config.model, **load), self.make_learner, run.out_dir, resume_step)
        self.algo = ALGORITHMS[config.algo](config, parts)
        self.reference = None
        if self.algo.needs_reference:  # with LoRA: the policy with its adapters off, no second copy (lora_run)
            ref = AdaptersOff(self.learner, policy) if config.lora_rank else None
            self.reference = ref or self.make_learner(load_model(config.model, **load), None)
        if run.state is not None:
            self.learner.load(run.ckpt_dir, run.state)
        say = print if run.is_main else (lambda line: None)
        context = policy.config.max_position_embeddings
        self.train_prompts, self.eval_prompts = load_prompts(config, tokenizer, context, log=say)
        self.reward_fn, self.reward_name = self._reward()
        builtin = config.reward == "task" and config.reward_model is None
        self.eval_key = "eval_exact_match" if builtin else "eval_reward"  # the built-in reward is exact match
        self.eval_label = "exact match" if builtin else "mean reward"
        longest = max(len(p.ids) for p in self.train_prompts + self.eval_prompts)
        engine_options = dataclasses.asdict(config.engine)
        engine_options.update(max_model_len=min(longest + config.max_new_tokens + 1, context), seed=config.seed)
        assert self.learner.engine_model is not None
        self.llm = LLM(self.learner.engine_model, tokenizer, **engine_options)
        engine = self.learner.engine_model
        shared = getattr(self.learner, "shares_weights", True)
        self.engine_copy_mb = 0.0 if shared else sum(p.numel() * p.element_size() for p in engine.parameters()) / 2**20
        self.on_policy = reuses_update_logprobs(config, self.algo, self.learner)
        self.algo.capture = self.on_policy
        run.open_log(self.learner.is_main)
        if not run.resumed:
            counts = {"num_train": len(self.train_prompts), "num_eval": len(self.eval_prompts)}
            trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
            run.log(
                {"step": 0, "algo": config.algo, **counts, "num_trainable_params": trainable, **sync_figures(policy)}
            )

    def make_learner(self, model, optim: OptimConfig | None) -> Learner:
        """A learner on the run's layout (the parallel trainer under torchrun); ``optim=None``: frozen."""
        t = self.config.temperature  # the loss's log-probs are those of the policy that samples at T
        if self.dims is None:
            return LocalLearner(model, optim, temperature=t)
        copy = "all" if optim is not None and model.config.num_labels is None else "none"
        return ParallelLearner(model, optim, self.config.parallel, self.dims, engine_copy=copy, temperature=t)

    def _reward(self):
        """(reward function of (completions, context), its name); the context is the answers, or the prompts'
        texts for a reward model."""
        if self.config.reward_model is None:
            return load_reward_fn(self.config.reward), "reward"
        from spinwheel.rl.llm.reward_model import reward_model_fn

        rm = reward_model_fn(self.config.reward_model, device=self.config.device)
        return (lambda completions, prompts: rm(prompts, completions)), "reward-model"

    def step(self, step: int) -> dict[str, Any]:
        """One rollout step: generate → score → log-probs → advantages → update → weight sync."""
        c, algo, learner = self.config, self.algo, self.learner
        times, comm_before = [time.perf_counter()], learner.comm_metrics()
        rows = batch_indices(step, c.prompts_per_step, len(self.train_prompts), c.seed)
        rollout = generate_rollout(
            self.llm,
            [self.train_prompts[i] for i in rows],
            step,
            c.seed,
            c.group_size,
            c.max_new_tokens,
            c.temperature,
            c.top_p,
            self.dims,
        )
        times.append(time.perf_counter())
        rewards = self.score(rollout)
        times.append(time.perf_counter())
        batch = {k: v.to(c.device) for k, v in rollout_batch(rollout, self.pad_id).items()}
        inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        if not learner.distributed:  # the local learner runs each group's shared prompt once
            inputs.update(prompt_lens=batch["prompt_lens"], completion_lens=batch["completion_lens"])
        old = None if self.on_policy else learner.forward(inputs)["logprobs"]
        ref = self.reference.forward(inputs)["logprobs"] if self.reference is not None else None
        times.append(time.perf_counter())
        mask = batch["mask"]
        keep = torch.ones(mask.shape[0], device=mask.device)
        if c.dynamic_sampling:  # DAPO: groups whose rewards are all equal carry no signal
            keep = dynamic_sampling_mask(rewards, c.group_size).float().to(mask.device)
        advantages = algo.prepare(rewards.to(mask.device), mask, inputs, old, ref)
        per_row = {**inputs, "mask": mask * keep[:, None], **advantages, **self.logprob_rows(old, ref, batch)}
        algo.captured.clear()
        stats = algo.update(learner, per_row, step)
        old = old if old is not None else algo.captured[0]  # the update's own forward: the rollout policy's
        times.append(time.perf_counter())
        learner.sync_engine_model()
        self.llm.update_weights(learner.engine_model)  # ZeRO-1/2 write through flat buckets: repack explicitly
        times.append(time.perf_counter())
        record = self.record(rewards, mask, keep, old, ref, batch["engine_logprobs"], stats, times)
        return {**record, **metrics_since(learner.comm_metrics(), comm_before)}  # log-probs, updates, weight sync

    def score(self, rollout: Rollout) -> torch.Tensor:
        """The rollout's rewards (B,); a reward function that fails (or a Ctrl-C while it runs) fails the step on
        every rank together, before any weight changed (the harness saves the steps before it)."""
        c, error = self.config, None
        context = [p.text if c.reward_model else p.answer for p in rollout.row_prompts]
        try:
            rewards = score(
                self.reward_fn,
                rollout.texts,
                context,
                self.reward_name,
                timeout_s=c.reward_timeout_s,
                should_stop=self.run.stop_requested,
            )
        except (RewardError, RewardInterrupted) as e:
            error = e
        if any_rank(error is not None, self.dims is not None):
            raise StepFailed(error or RewardError("the reward failed on another rank (that rank's log says why)"))
        return rewards

    def logprob_rows(self, old, ref, batch) -> dict[str, torch.Tensor]:
        """The per-row log-prob tensors the loss reads besides the algorithm's: reference, old policy, and the
        truncated importance weights (or the engine's log-probs, when the loss computes them itself)."""
        rows, engine_logprobs = {}, batch["engine_logprobs"]
        if ref is not None:
            rows["ref_logprobs"] = ref
        if old is not None:
            rows["old_logprobs"] = old
            if self.config.tis_cap is not None:
                rows["is_weights"] = truncated_is_weights(old, engine_logprobs, self.config.tis_cap)
        elif self.config.tis_cap is not None:
            rows["engine_logprobs"] = engine_logprobs
        return rows

    def record(self, rewards, mask, keep, old, ref, engine_logprobs, stats, times) -> dict[str, Any]:
        """The step's figures: rewards, lengths, kept groups, mismatch, the update's stats, KL, phase times."""
        c = self.config
        record = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "response_len": float(mask.sum(1).mean()),
            "kept_groups": float(keep.sum()) / c.group_size,
            **{k: float(v) for k, v in logprob_mismatch(old, engine_logprobs, mask).items()},
            **stats,
        }
        if ref is not None:
            weights = token_weights(mask, "token-mean")
            record["kl_ref"] = float((weights * kl_per_token(old, ref, c.kl_estimator)).sum())
        record.update({f"time/{p}": times[i + 1] - times[i] for i, p in enumerate(PHASES)})
        record["tokens_per_s"] = float(mask.sum()) / (times[-1] - times[0])
        record["engine_copy_mb"] = self.engine_copy_mb
        return record

    def evaluate(self, step: int) -> float | None:
        """The held-out mean reward of greedy completions under the run's own reward (for the built-in task's
        reward: exact match), on the main rank (the engine holds the current weights)."""
        if not self.learner.is_main or not self.eval_prompts:
            return None
        c = self.config
        greedy = SamplingParams(temperature=0.0, max_tokens=c.max_new_tokens)
        examples = self.eval_prompts[: c.eval_examples]
        completions = [o.outputs[0].text for o in self.llm.generate([list(p.ids) for p in examples], greedy)]
        context = [p.text if c.reward_model else p.answer for p in examples]
        rewards = score(self.reward_fn, completions, context, self.reward_name, timeout_s=c.reward_timeout_s)
        value = float(rewards.mean())
        self.run.log({"step": step, self.eval_key: value})
        return value

    def save(self, ckpt_dir: Path, state: dict[str, Any]) -> None:
        self.algo.save(self.run.out_dir, state)  # first: a policy checkpoint never points at a missing part
        self.learner.save(ckpt_dir, self.tokenizer, state)
