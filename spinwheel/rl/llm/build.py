"""The prompts an RL run samples from: the built-in task's splits or a JSONL (plain prompts or chat messages)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from spinwheel.models.tokenizer import TokenizerError
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.rollout import Prompt, prompts_from_task
from spinwheel.tasks.arithmetic import ArithmeticTask
from spinwheel.tasks.data import DataError, RLRecord, check_integer_answers, describe_skipped, read_rl_jsonl


def load_prompts(
    config: RLConfig, tokenizer, max_context: int | None = None, log: Callable[[str], None] = print
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) prompts: the built-in arithmetic task's splits, or ``--data`` split by ``eval_fraction``.

    With ``max_context`` (the model's ``max_position_embeddings``), ``--data`` prompts that leave no room for
    ``--max-new-tokens`` are skipped, counted in one line to ``log`` naming their ``path:line``; fewer than two
    prompts left (one to train on, one held out) is a :class:`DataError`."""
    if config.data is None:
        task = ArithmeticTask(config.task)
        return prompts_from_task(tokenizer, task.train), prompts_from_task(tokenizer, task.test)
    trl_style = False
    if config.reward != "task" and config.reward_model is None:
        from spinwheel.envs.dataset import is_trl_style
        from spinwheel.rl.llm.rewards import RewardError, load_reward_fn

        try:
            trl_style = is_trl_style(load_reward_fn(config.reward))  # it may read other columns than the answer
        except RewardError:
            pass  # the run reports it where it loads the reward
    records = read_rl_jsonl(config.data, require_answer=not trl_style)
    if config.reward == "task" and config.reward_model is None:
        check_integer_answers(records)
    plain = iter(prompts_from_task(tokenizer, [r for r in records if r.messages is None]))
    rows = [next(plain) if r.messages is None else chat_prompt(tokenizer, r, config.data) for r in records]
    rows = [dataclasses.replace(p, record=r) for p, r in zip(rows, records)]  # the reward may read its columns
    if max_context is not None:
        room = max_context - config.max_new_tokens
        skipped = [f"{r.where} ({len(p.ids)} tokens)" for r, p in zip(records, rows) if len(p.ids) > room]
        if skipped:
            why = (
                f"do not fit the model's context of {max_context} tokens with --max-new-tokens {config.max_new_tokens}"
            )
            log(f"{config.data}: " + describe_skipped(skipped, "prompts", why))
            rows = [p for p in rows if len(p.ids) <= room]
    if len(rows) < 2:
        raise DataError(
            f"{config.data}: {len(rows)} usable prompt(s); RL needs at least 2 (one to train on, one held out "
            "for evaluation)"
        )
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(config.seed)).tolist()
    num_eval = max(1, int(len(rows) * config.eval_fraction))
    return [rows[i] for i in order[num_eval:]], [rows[i] for i in order[:num_eval]]


def chat_prompt(tokenizer, record: RLRecord, path: str) -> Prompt:
    """A ``messages`` line rendered with the tokenizer's chat template and the assistant's generation prompt; the
    template writes its own special tokens (BOS), so the text is tokenized without adding them again."""
    try:
        text = tokenizer.apply_chat_template(record.messages, add_generation_prompt=True)
    except TokenizerError as e:
        raise DataError(f"{path}: 'messages' lines need the checkpoint's chat template: {e}") from None
    return Prompt(text, tuple(tokenizer.encode(text, add_special_tokens=False)), record.answer)
