"""The LLM policy-gradient loop: prompts → the engine samples G completions each from the trainer's *current*
weights → rewards → old (and reference) log-probs from the trainer's forward → advantages → ``epochs`` passes of
``minibatches`` optimizer steps → the new weights reach the engine → repeat.

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
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.hf import load_model
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.parallel.comm import metrics_since
from spinwheel.parallel.token_outputs import TokenOutputs
from spinwheel.parallel.trainer import Batch, LossFn
from spinwheel.rl.llm.build import load_prompts, make_algorithm
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.ppo import PPO
from spinwheel.rl.llm.rewards import load_reward_fn, score
from spinwheel.rl.llm.rollout import generate_rollout, rollout_batch
from spinwheel.rl.llm.trpo import TRPO
from spinwheel.rl.token_losses import kl_per_token, logprob_mismatch, token_weights, truncated_is_weights
from spinwheel.tasks.arithmetic import evaluate
from spinwheel.train.checkpoint import load_trainer_state
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
from spinwheel.train.sft_data import batch_indices


def reuses_update_logprobs(config: RLConfig, algo, learner: Learner) -> bool:
    """Whether the old-policy log-probs can be the update's own (detached) instead of a separate forward.

    With one update per rollout in one process the old policy is the current one (ratio exactly 1), so the extra
    no-grad forward is redundant; the loss hands its log-probs back for the mismatch and KL figures. Several updates
    (μ > 1 or minibatches), REINFORCE++'s KL in the reward (needed before the update) and parallel layouts (each
    rank's loss sees only its rows) keep the exact forward.
    """
    return (
        config.updates_per_step == 1
        and not getattr(algo, "kl_in_reward", False)
        and not learner.distributed
        and config.algo not in ("ppo", "trpo")
    )  # PPO's KL reward and TRPO's surrogate need them first


def train_rl(config: RLConfig) -> dict[str, Any]:
    """Run the configured algorithm; returns the final figures (``eval_before``, ``eval_after``, ``history``)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    with distributed_world(config.device, config.parallel) as distributed:
        return _run(config, distributed)


def _run(config: RLConfig, distributed: bool) -> dict[str, Any]:
    dims = config.parallel.make_dims()
    config.parallel.check_batch(config.rollout_batch // config.minibatches, dims.dp, what="the minibatch of")
    out_dir, ckpt_dir = Path(config.out_dir), Path(config.out_dir) / "checkpoint"
    state = load_trainer_state(ckpt_dir) if config.resume and ckpt_dir.is_dir() else None
    start_step, changes = resume_point(config, state, ckpt_dir, OBSERVATION_OPTIONS) if state is not None else (0, [])
    main = is_main_process()
    if state is not None and start_step == config.steps:
        if main:
            print(finished_message(start_step, config.steps, ckpt_dir), flush=True)
        return {"start_step": start_step, "end_step": start_step, "finished": True, "checkpoint": str(ckpt_dir)}
    if state is not None and main:
        print(resume_message(start_step, config.steps, ckpt_dir, changes), flush=True)
    tokenizer = load_tokenizer(ckpt_dir if state is not None else config.model)
    pad_id = tokenizer.pad_id or 0
    load = dict(dtype=config.dtype, device=config.device, seed=config.seed, vocab_size=tokenizer.vocab_size)
    policy = load_model(ckpt_dir if state is not None else config.model, **load)
    reference = load_model(config.model, **load) if config.beta > 0 else None
    optim = OptimConfig(config.lr, config.weight_decay, config.grad_clip, fused=True)
    learner: Learner
    ref: Learner | None = None
    if distributed:
        learner = ParallelLearner(policy, optim, config.parallel, dims, engine_copy="all")
        if reference is not None:
            ref = ParallelLearner(reference, None, config.parallel, dims, engine_copy="none")
    else:
        learner = LocalLearner(policy, optim)
        ref = LocalLearner(reference, None) if reference is not None else None
    algo = make_algorithm(
        config,
        lambda: load_model(config.model, **load),
        distributed,
        dims,
        out_dir / "critic" if state is not None else None,
        int(state["step"]) if state is not None else 0,
    )
    if state is not None:
        learner.load(ckpt_dir, state)
    train_prompts, eval_prompts = load_prompts(config, tokenizer)
    if config.reward_model is not None:  # scores (prompt, completion); the loop hands it the prompts' texts
        from spinwheel.rl.llm.reward_model import reward_model_fn

        rm = reward_model_fn(config.reward_model, device=config.device)
        reward_fn = lambda completions, prompts: rm(prompts, completions)  # noqa: E731
    else:
        reward_fn = load_reward_fn(config.reward)
    longest = max(len(p.ids) for p in train_prompts + eval_prompts)
    engine_options = dataclasses.asdict(config.engine)
    engine_options.update(max_model_len=longest + config.max_new_tokens + 1, seed=config.seed)
    assert learner.engine_model is not None
    llm = LLM(learner.engine_model, tokenizer, **engine_options)
    engine_copy_mb = (
        0.0
        if getattr(learner, "shares_weights", True)
        else sum(p.numel() * p.element_size() for p in learner.engine_model.parameters()) / 2**20
    )
    logger = MetricsLogger(out_dir, resume_step=start_step if state is not None else None) if learner.is_main else None

    def log(record: dict[str, Any]) -> None:
        if logger is not None:
            logger.log(record)

    def run_eval(step: int) -> float | None:
        if not learner.is_main or not eval_prompts:
            return None
        greedy = SamplingParams(temperature=0.0, max_tokens=config.max_new_tokens)
        examples = eval_prompts[: config.eval_examples]
        ids = {p.text: list(p.ids) for p in examples}
        result = evaluate(
            lambda texts: [o.outputs[0].text for o in llm.generate([ids[t] for t in texts], greedy)],
            examples,
            batch_size=len(examples),
        )
        log({"step": step, "eval_exact_match": result.exact_match})
        return result.exact_match

    def save(step: int) -> None:
        if isinstance(algo, PPO):  # the critic first: a policy checkpoint never points at a missing critic
            algo.critic.save(out_dir / "critic", None, {"step": step, "kl_coef": algo.kl.state_dict()})
        learner.save(ckpt_dir, tokenizer, {"step": step, "config": dataclasses.asdict(config)})

    result: dict[str, Any] = {"start_step": start_step}
    if state is None:
        log({"step": 0, "algo": config.algo, "num_train": len(train_prompts), "num_eval": len(eval_prompts)})
        result["eval_before"] = run_eval(0)
    end_step = config.steps if config.stop_after is None else min(config.steps, start_step + config.stop_after)
    total_updates = config.steps * config.updates_per_step
    history: list[dict[str, Any]] = []
    on_policy = reuses_update_logprobs(config, algo, learner)
    trained: list[torch.Tensor] = []

    def loss_fn(out: TokenOutputs, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if on_policy and out.logprobs is not None:
            trained.append(out.logprobs.detach())
        return algo.loss(out, mb)

    bar = tqdm(
        range(start_step, end_step),
        total=config.steps,
        initial=start_step,
        desc=config.algo,
        disable=not (config.progress and learner.is_main),
        dynamic_ncols=True,
        mininterval=1.0 if sys.stderr.isatty() else 10.0,
    )
    with StopOnSignal(learner.distributed) as stop:
        for step in bar:
            t = {"start": time.perf_counter()}
            comm_before = learner.comm_metrics()
            idx = batch_indices(step, config.prompts_per_step, len(train_prompts), config.seed)
            rollout = generate_rollout(
                llm,
                [train_prompts[i] for i in idx],
                step,
                config.seed,
                config.group_size,
                config.max_new_tokens,
                config.temperature,
                config.top_p,
                dims if distributed else None,
            )
            t["generate"] = time.perf_counter()
            context = [p.text if config.reward_model else p.answer for p in rollout.row_prompts]
            rewards = score(reward_fn, rollout.texts, context, "reward-model" if config.reward_model else "reward")
            t["score"] = time.perf_counter()
            batch = {k: v.to(config.device) for k, v in rollout_batch(rollout, pad_id).items()}
            inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
            if not learner.distributed:  # the local learner runs each group's shared prompt once
                inputs.update(prompt_lens=batch["prompt_lens"], completion_lens=batch["completion_lens"])
            old = None if on_policy else learner.forward(inputs)["logprobs"]
            ref_logp = ref.forward(inputs)["logprobs"] if ref is not None else None
            t["logprobs"] = time.perf_counter()
            mask = batch["mask"]
            prepared = algo.prepare(rewards.to(mask.device), mask, inputs, old, ref_logp)
            keep = torch.ones(mask.shape[0], device=mask.device)
            if config.dynamic_sampling:
                from spinwheel.rl.llm_advantages import dynamic_sampling_mask

                keep = dynamic_sampling_mask(rewards, config.group_size).float().to(mask.device)
            per_row = {**inputs, "mask": mask * keep[:, None], **prepared}
            if ref_logp is not None:
                per_row["ref_logprobs"] = ref_logp
            if old is not None:
                per_row["old_logprobs"] = old
                if config.tis_cap is not None:
                    per_row["is_weights"] = truncated_is_weights(old, batch["engine_logprobs"], config.tis_cap)
            elif config.tis_cap is not None:
                per_row["engine_logprobs"] = batch["engine_logprobs"]  # the loss weights by its own log-probs
            trained.clear()
            stats = _update(config, learner, algo, loss_fn, per_row, step, total_updates)
            if old is None:
                old = trained[0]  # the update's own forward: the rollout policy's log-probs, detached
            t["update"] = time.perf_counter()
            learner.sync_engine_model()
            llm.update_weights(learner.engine_model)  # ZeRO-1/2 write through flat buckets: repack explicitly
            t["sync"] = time.perf_counter()
            weights = token_weights(mask, "token-mean")
            record = {
                "step": step + 1,
                "reward_mean": float(rewards.mean()),
                "reward_std": float(rewards.std()),
                "response_len": float(mask.sum(1).mean()),
                "kept_groups": float(keep.sum()) / config.group_size,
                **{k: float(v) for k, v in logprob_mismatch(old, batch["engine_logprobs"], mask).items()},
                **stats,
            }
            if ref_logp is not None:
                record["kl_ref"] = float((weights * kl_per_token(old, ref_logp, config.kl_estimator)).sum())
            phases = ["generate", "score", "logprobs", "update", "sync"]
            prev = ["start"] + phases[:-1]
            record.update({f"time/{p}": t[p] - t[q] for p, q in zip(phases, prev)})
            record["tokens_per_s"] = float(mask.sum()) / (t["sync"] - t["start"])
            record["engine_copy_mb"] = engine_copy_mb
            record.update(metrics_since(learner.comm_metrics(), comm_before))  # log-probs, updates, weight sync
            log(record)
            history.append(record)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", refresh=False)
            done = step + 1
            if done < end_step and (signum := stop.agreed()) is not None:  # every rank stops after this step
                bar.close()
                save(done)
                raise stop.interrupted(signum, done, ckpt_dir, learner.is_main, config.resume)
            if config.eval_every and done % config.eval_every == 0 and done < config.steps:
                if (em := run_eval(done)) is not None:
                    bar.write(f"step {done}: held-out exact match {em:.3f}")
            if config.save_every and done % config.save_every == 0 and done < end_step:
                save(done)
    bar.close()
    save(end_step)
    result.update(history=history, end_step=end_step, checkpoint=str(ckpt_dir))
    if end_step == config.steps:
        result["eval_after"] = run_eval(end_step)
    if logger is not None:
        plot_curves(
            logger.read(),
            out_dir / "curves.png",
            [
                ("reward_mean", "sampled reward"),
                ("eval_exact_match", "held-out exact match (greedy)"),
                ("kl_ref" if config.beta > 0 else "approx_kl", "KL"),
                ("clip_frac", "clip fraction"),
                ("response_len", "completion tokens"),
            ],
            title=f"{config.algo} {config.model}",
        )
    return result


def _update(
    config: RLConfig,
    learner: Learner,
    algo,
    loss_fn: LossFn,
    per_row: dict[str, torch.Tensor],
    step: int,
    total_updates: int,
) -> dict[str, float]:
    """``epochs`` passes of ``minibatches`` optimizer steps over the rollout batch (TRPO: one trust-region step);
    PPO steps its critic on each minibatch too. Returns the mean stats."""
    if isinstance(algo, TRPO):
        batch = {k: v for k, v in per_row.items() if k != "mask"}
        batch["weights"] = token_weights(per_row["mask"], config.loss_agg, max_len=config.max_new_tokens)
        return algo.update(learner, batch)
    b = per_row["input_ids"].shape[0]
    size = b // config.minibatches
    sums: dict[str, float] = {}
    n = 0
    for epoch in range(config.epochs):
        gen = torch.Generator().manual_seed((config.seed * 1_000_003 + step) * 97 + epoch)
        order = torch.randperm(b, generator=gen) if config.minibatches > 1 else None
        for k in range(config.minibatches):
            if order is None:  # the whole batch in its order: no copies
                mb, mask = {key: v for key, v in per_row.items() if key != "mask"}, per_row["mask"]
            else:
                rows = order[k * size : (k + 1) * size].to(per_row["input_ids"].device)
                mb = {key: v[rows] for key, v in per_row.items() if key != "mask"}
                mask = per_row["mask"][rows]
            mb["weights"] = token_weights(mask, config.loss_agg, max_len=config.max_new_tokens)
            update = step * config.updates_per_step + n
            lr = lr_at(update, config.lr, config.warmup_steps, total_updates, config.min_lr_ratio)
            out = learner.train_step(mb, loss_fn, lr, entropy=True)
            extra = algo.critic_step(mb, mask, lr / config.lr) if isinstance(algo, PPO) else {}
            for key, v in {**out.stats, **extra, "loss": out.loss, "grad_norm": out.grad_norm or 0.0, "lr": lr}.items():
                sums[key] = sums.get(key, 0.0) + v
            n += 1
    return {key: v / n for key, v in sums.items()}
