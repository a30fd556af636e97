"""Reward models: a scalar-head copy of an LM trained with the Bradley–Terry loss on preference pairs (Ouyang et
al. 2022, InstructGPT §3.5), saved so that ``transformers`` loads it as ``LlamaForSequenceClassification`` /
``Qwen2ForSequenceClassification``, and usable as an RL reward (:func:`reward_model_fn`).

A sequence's score is the model's value at its last token (right-padded rows; the completion carries no EOS, see
:mod:`.preference_data`) — the token HF's sequence classifiers pool, so ours and theirs agree. Pairs come from a
JSONL file or from the arithmetic task (the right answer against a random wrong number); with ``--policy`` the
model is also tested on pairs whose wrong answer is that policy's own mistake, sampled on spinwheel's engine —
the mistakes an RL reward has to catch, and harder than random numbers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spinwheel.engine import LLM
from spinwheel.models.hf import load_config, load_model
from spinwheel.models.tokenizer import Tokenizer, load_tokenizer
from spinwheel.models.transformer import Transformer, scalar_head_model
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.parallel.token_outputs import TokenOutputs
from spinwheel.parallel.trainer import Batch
from spinwheel.preference import pref_loop
from spinwheel.preference.pref_config import RMConfig
from spinwheel.preference.preference_data import (
    PreferencePair,
    arithmetic_pairs,
    mistake_pairs,
    pair_tokens,
    pairs_from_jsonl,
    split_pairs,
    task_prompts,
)
from spinwheel.preference.preference_losses import bradley_terry_loss
from spinwheel.tasks.arithmetic import ArithmeticTask
from spinwheel.train.learners import Learner, is_main_process
from spinwheel.train.lora_run import adapt_scalar_head, check_one_process, lora_head_state
from spinwheel.train.run import Run


class RewardModelError(ValueError):
    """A checkpoint that is not a reward model where one is needed."""


def rm_batch(pairs: Sequence[PreferencePair], pad_id: int, device: str | torch.device = "cpu") -> Batch:
    """The trainer batch of ``pairs``: ``input_ids`` (2P, L) interleaved chosen/rejected sequences, ``labels``
    (unused by a scalar head), ``score_index`` (2P,) each row's last token, ``pair_weights`` (2P,) ``1/P``."""
    tokens, lengths, _ = pair_tokens(pairs, pad_id)
    batch = {
        "input_ids": tokens,
        "labels": torch.zeros_like(tokens),
        "score_index": lengths - 1,
        "pair_weights": torch.full((tokens.shape[0],), 1.0 / len(pairs)),
    }
    return {k: v.to(device) for k, v in batch.items()}


def sequence_scores(values: torch.Tensor, score_index: torch.Tensor) -> torch.Tensor:
    """Per-token values (b, T) -> each row's score (b,) at its last token ``score_index`` (b,)."""
    return values.gather(1, score_index[:, None]).squeeze(1)


def bradley_terry_pair_loss(out: TokenOutputs, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's contribution to the global Bradley–Terry loss: pairs are rows (2i, 2i+1) and weigh
    ``1/P_global`` each, so the shards' sums are the whole batch's mean."""
    assert out.values is not None, "the reward-model loss needs a scalar-head model (num_labels 1)"
    r = sequence_scores(out.values, mb["score_index"])
    return bradley_terry_loss(r[0::2], r[1::2], weights=mb["pair_weights"][0::2])


def score_pairs(
    learner: Learner, pairs: Sequence[PreferencePair], pad_id: int, chunk: int, device: str | torch.device = "cpu"
) -> dict[str, float]:
    """Held-out figures of a reward model on ``pairs``: ``accuracy`` (share with score(chosen) > score(rejected),
    ties counted wrong) and ``margin`` (mean score gap). Collective under torchrun."""
    if not pairs:
        return {"accuracy": float("nan"), "margin": float("nan")}
    r = pref_loop.forward_rows(
        learner,
        pairs,
        lambda part: rm_batch(part, pad_id, device),
        lambda out, batch: sequence_scores(out["values"], batch["score_index"]),
        chunk,
    )
    gap = r[0::2] - r[1::2]
    return {"accuracy": float((gap > 0).float().mean()), "margin": float(gap.mean())}


def load_reward_model(
    path: str | os.PathLike, *, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
) -> Transformer:
    """Load a reward-model checkpoint; a checkpoint of any other kind raises :class:`RewardModelError`."""
    config = load_config(path)
    if config.num_labels != 1:
        raise RewardModelError(
            f"{path} is not a reward model (num_labels != 1): its config.json describes a "
            f"{config.model_type} causal LM; train one with `spinwheel rm`"
        )
    return load_model(path, dtype=dtype, device=device)


def reward_model_fn(
    path: str | os.PathLike, *, device: str | torch.device = "cpu", batch_size: int = 64
) -> Callable[[list[str], list[str]], list[float]]:
    """A reward function over a reward-model checkpoint: ``fn(prompts, completions) -> list[float]``, one score
    per (prompt, completion), tokenized as in training (the prompt with BOS, the completion without EOS)."""
    model = load_reward_model(path, device=device).eval()
    tokenizer = load_tokenizer(path)
    pad_id = tokenizer.pad_id or 0

    @torch.no_grad()
    def score(prompts: list[str], completions: list[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"reward model: {len(prompts)} prompts for {len(completions)} completions")
        out: list[float] = []
        for start in range(0, len(prompts), batch_size):
            p_ids = tokenizer.encode_batch(prompts[start : start + batch_size])
            c_ids = tokenizer.encode_batch(completions[start : start + batch_size], add_special_tokens=False)
            seqs = [p + c for p, c in zip(p_ids, c_ids)]
            tokens = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
            for i, s in enumerate(seqs):
                tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            last = torch.tensor([len(s) - 1 for s in seqs])
            values = model(tokens.to(device))[..., 0].float()  # (b, T)
            out += sequence_scores(values, last.to(device)).tolist()
        return out

    return score


def _pairs(
    config: RMConfig, tokenizer: Tokenizer, max_context: int
) -> tuple[list[PreferencePair], list[PreferencePair], int]:
    """(train, held-out, dropped) pairs: the task's right answers against random wrong numbers, or the JSONL."""
    if config.data is None:
        task = ArithmeticTask(config.task)
        train = arithmetic_pairs(task.train[: config.num_train_pairs], tokenizer, config.seed, add_eos=False)
        held_out = arithmetic_pairs(task.test[: config.eval_examples], tokenizer, config.seed + 1, add_eos=False)
        return train, held_out, 0
    say = print if is_main_process() else None
    pairs, dropped = pairs_from_jsonl(
        config.data, tokenizer, add_eos=False, max_seq_len=config.max_seq_len, max_context=max_context, log=say
    )
    train, held_out = split_pairs(pairs, config.eval_fraction, config.seed)
    if not train:
        raise ValueError(f"{config.data}: too few pairs to train on ({len(pairs)}); add pairs")
    return train, held_out[: config.eval_examples], dropped


def _policy_mistakes(config: RMConfig, tokenizer: Tokenizer, dims: ParallelDims | None) -> list[PreferencePair]:
    """Held-out pairs of (right answer, a wrong sample of ``config.policy``), sampled once on the engine."""
    assert config.policy is not None
    if config.data is not None:
        raise ValueError("--policy needs the built-in task: JSONL pairs carry no answers to judge samples by")
    policy = load_model(config.policy, dtype=config.dtype, device=config.device)
    if policy.config.num_labels is not None:
        raise ValueError(f"--policy {config.policy} is a reward model (num_labels 1), not a policy to sample from")
    policy_tokenizer = load_tokenizer(config.policy)
    prompts = task_prompts(policy_tokenizer, ArithmeticTask(config.task).test[: config.eval_examples])
    engine = dataclasses.asdict(config.engine)
    engine.update(max_model_len=max(len(p.ids) for p in prompts) + config.max_new_tokens + 1, seed=config.seed)
    llm = LLM(policy, policy_tokenizer, **engine)
    groups = pref_loop.sample_policy(llm, prompts, config, dims)
    llm.close()
    return mistake_pairs(groups, tokenizer, add_eos=False)


def train_rm(config: RMConfig) -> dict[str, Any]:
    """Train a reward model as configured; returns ``eval_before`` / ``eval_after`` (held-out ``accuracy`` and
    ``margin``, and ``policy_accuracy`` with ``--policy``), ``history`` and ``checkpoint``.

    Under ``torchrun`` with more than one process this trains on the parallel trainer (``config.parallel``; any
    layout: a 1-row score head stays whole under tensor parallelism); otherwise in this process.
    """
    return pref_loop.run_pair_command(config, "rm", _train)


def _train(config: RMConfig, run: Run, dims: ParallelDims | None) -> dict[str, Any]:
    tokenizer = load_tokenizer(run.ckpt_dir if run.resumed else config.model)
    pad_id = tokenizer.pad_id or 0
    check_one_process(config, dims is not None, "rm")
    source = run.ckpt_dir if run.resumed and not config.lora_rank else config.model  # LoRA: resumed on the base
    load = dict(dtype=config.dtype, device=config.device, seed=config.seed, vocab_size=tokenizer.vocab_size)
    model = load_model(source, **load, lazy=dims is not None and not config.lora_rank)  # lazy: lazy_load.py
    if model.config.num_labels is None:
        model = scalar_head_model(model, seed=config.seed)
    model = adapt_scalar_head(model, config, run.state)  # --lora-rank: adapters on the body, the head trained
    model.config.pad_token_id = pad_id  # HF's sequence classifiers pool the last token that is not the pad
    train_pairs, eval_pairs, dropped = _pairs(config, tokenizer, model.config.max_position_embeddings)
    mistakes = _policy_mistakes(config, tokenizer, dims) if config.policy is not None else []
    learner = pref_loop.make_learner(model, config, dims)
    if run.state is not None:
        learner.load(run.ckpt_dir, run.state)
    run.open_log(learner.is_main)
    if not run.resumed:
        counts = dict(num_train=len(train_pairs), num_eval=len(eval_pairs), num_policy_pairs=len(mistakes))
        num_params = sum(p.numel() for p in model.parameters())
        run.log({"step": 0, "num_params": num_params, **counts, "num_dropped": dropped})

    def evaluate(step: int) -> dict[str, Any]:
        ev: dict[str, Any] = {}
        if eval_pairs:  # none held out (a tiny --data): nothing to score, rather than NaN figures
            held_out = score_pairs(learner, eval_pairs, pad_id, config.batch_size, config.device)
            ev.update(eval_accuracy=held_out["accuracy"], eval_margin=held_out["margin"])
        if mistakes:
            on_mistakes = score_pairs(learner, mistakes, pad_id, config.batch_size, config.device)
            ev["eval_policy_accuracy"] = on_mistakes["accuracy"]
        run.log({"step": step, **ev})
        return ev

    def save(ckpt_dir, state: dict[str, Any]) -> None:
        learner.save(ckpt_dir, tokenizer, {**state, **lora_head_state(model)})

    model.train()
    build = lambda part: rm_batch(part, pad_id, config.device)  # noqa: E731
    job = pref_loop.PairJob(config, run, learner, train_pairs, build, bradley_terry_pair_loss, evaluate, save)
    curves = [
        ("loss", "Bradley-Terry loss"),
        ("accuracy", "train pair accuracy"),
        ("eval_accuracy", "held-out accuracy (random wrong)"),
        ("eval_policy_accuracy", "held-out accuracy (policy's mistakes)"),
    ]
    result = run.train(job, curves, f"RM {config.model}", pref_loop.pair_postfix)
    return {**result, "num_policy_pairs": len(mistakes)}
