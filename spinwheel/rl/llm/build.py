"""The prompts an RL run samples from: the built-in task's splits or a JSONL (plain prompts or chat messages)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from spinwheel.envs.chat import ChatFormat
from spinwheel.models.tokenizer import TokenizerError
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.episode_tokens import first_tokens
from spinwheel.rl.llm.rollout import Prompt, prompts_from_task
from spinwheel.tasks.arithmetic import ArithmeticTask
from spinwheel.tasks.data import DataError, RLRecord, check_integer_answers, describe_skipped, read_rl_jsonl


def load_prompts(
    config: RLConfig,
    tokenizer,
    max_context: int | None = None,
    log: Callable[[str], None] = print,
    chat: ChatFormat | None = None,
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) prompts: the built-in arithmetic task's splits, or ``--data`` split by ``eval_fraction``.
    With ``chat`` (``--chat``) a plain prompt's ids are its text rendered as the user's turn with the chat template
    (the system prompt first), as the episode renders it; its ``text`` stays the raw prompt.

    With ``max_context`` (the model's ``max_position_embeddings``), ``--data`` prompts that leave no room for
    ``--max-new-tokens`` are skipped, counted in one line to ``log`` naming their ``path:line``; fewer than two
    prompts left (one to train on, one held out) is a :class:`DataError`."""
    if config.data is None:
        task = ArithmeticTask(config.task)
        return plain_prompts(tokenizer, task.train, chat), plain_prompts(tokenizer, task.test, chat)
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
    plain = iter(plain_prompts(tokenizer, [r for r in records if r.messages is None], chat))
    rows = [next(plain) if r.messages is None else chat_prompt(tokenizer, r, config.data, chat) for r in records]
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


def plain_prompts(tokenizer, examples, chat: ChatFormat | None) -> list[Prompt]:
    """Prompts of raw-text examples (``.prompt``, ``.answer``): tokenized with BOS, or under ``chat`` rendered as the
    user's turn (:func:`~spinwheel.rl.llm.episode_tokens.first_tokens`, what the episode feeds the engine)."""
    if chat is None:
        return prompts_from_task(tokenizer, examples)
    return [Prompt(e.prompt, tuple(first_tokens(tokenizer, e.prompt, chat)[0]), str(e.answer)) for e in examples]


def chat_prompt(tokenizer, record: RLRecord, path: str, chat: ChatFormat | None = None) -> Prompt:
    """A ``messages`` line rendered with the tokenizer's chat template and the assistant's generation prompt (the
    system prompt first under ``chat``); the template writes its own special tokens (BOS), so the text is tokenized
    without adding them again."""
    messages = chat.first(record.messages) if chat is not None else record.messages
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TokenizerError as e:
        raise DataError(f"{path}: 'messages' lines need the checkpoint's chat template: {e}") from None
    return Prompt(text, tuple(tokenizer.encode(text, add_special_tokens=False)), record.answer)
