"""An episode as the trainer takes it: the :class:`Episode` record, observations into tokens, the drift that
token-in/token-out avoids, and the trainer's batch (:mod:`~spinwheel.rl.llm.episodes` plays the episodes).

Observations become tokens once, when they arrive, and are never re-derived from text afterwards:

- **raw text**: the first observation is encoded with the tokenizer's special tokens (BOS, exactly as a single-turn
  prompt is), later ones with ``add_special_tokens=False``; the tokens are appended as they are.
- **chat messages**: the first observation is rendered with the chat template (``add_generation_prompt=True``) and
  encoded without special tokens (templates write BOS themselves). Under ``--chat`` (:mod:`~spinwheel.envs.chat`)
  raw text is a chat observation too: the first one the user's turn (after the system prompt), later ones the next
  user turn. After a turn only the *new suffix* is tokenized:
  with ``history`` the messages so far and ``a`` the turn's text as an assistant message,

  ======== =====================================================
  opened   ``render(history, add_generation_prompt=True)`` — what the model continued
  closed   ``render(history + [a])`` — ``opened + a.content + closing`` (the template's end-of-turn scaffolding)
  full     ``render(history + [a] + new, add_generation_prompt=True)``
  suffix   ``closing + full[len(closed):]``
  ======== =====================================================

  where ``closing`` loses a leading EOS text when the turn already sampled EOS. A template that is not append-only
  (one that rewrites earlier turns, or trims the assistant's text) fails the episode with that message.

Drift (:func:`has_drift`): whether ``encode(decode(token_ids))`` — what a text-based pipeline would train on — differs
from the episode's tokens. It is measured, never used.

Batch layout (:func:`episode_batch`), one row per episode, right-padded, as ``rollout_batch`` lays out single-turn
rows: ``input_ids = tokens[:-1]``, ``labels = tokens[1:]``; ``mask`` is 1 where the label is a sampled token;
``turn_rewards`` holds each turn's reward at the label position of the turn's last sampled token (PPO's per-turn
rewards), 0 elsewhere and on the rows of failed episodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from spinwheel.envs.base import Message, Observation
from spinwheel.envs.chat import ChatFormat
from spinwheel.models.tokenizer import Tokenizer


@dataclass
class Episode:
    """One episode, as the trainer takes it. Lists of tokens are aligned: ``mask[i]`` is 1 when ``token_ids[i]``
    was sampled, ``engine_logprobs[i]`` its log-prob under the tempered distribution it was drawn from (0 off the
    mask). ``turn_ends[k]`` is the index in ``token_ids`` of turn k's last sampled token, ``turn_rewards[k]`` the
    reward ``step`` gave that turn."""

    env_index: int
    sample_index: int
    env_seed: int
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    engine_logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0  # tokens of the first observation
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)  # each turn's text as the environment received it
    reward: float = 0.0  # the sum of the turn rewards (also when truncated)
    num_turns: int = 0
    done: bool = False  # the environment ended it
    truncated: bool = False  # the turn or token limit ended it first
    end_reason: str = ""  # "done", "max_turns", "max_tokens", "failed"
    failed: bool = False
    error: str | None = None
    info: dict[str, float] = field(default_factory=dict)  # the steps' figures (a later step's value wins)
    drift: bool = False  # re-tokenising the decoded text would give other tokens
    versions: list[int] = field(default_factory=list)  # policy version of each sampled token, in order (asynchronous)


@dataclass
class EpisodeConfig:
    """How episodes are sampled and bounded."""

    max_new_tokens: int = 64  # tokens per turn at most (cut to what fits the episode's limit)
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int | None = None  # None: the environment's max_turns; else the smaller of the two
    max_total_tokens: int | None = None  # tokens per episode at most; None: the model's context
    env_timeout_s: float | None = 30.0  # per reset/step call; None: wait forever
    batch_timeout_s: float | None = 300.0  # a batched step (one-step environments' reward call); None: no limit
    max_observation_chars: int = 64 * 1024  # a larger observation fails the episode
    num_env_workers: int = 16  # environment calls running at once
    chat: ChatFormat | None = None  # raw-text observations as chat turns (--chat); None: appended as text

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_turns", "max_total_tokens", "max_observation_chars", "num_env_workers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"EpisodeConfig.{name} must be an integer >= 1, got {value!r}")
        if self.env_timeout_s is not None and not self.env_timeout_s > 0:
            raise ValueError(f"EpisodeConfig.env_timeout_s must be > 0 or None, got {self.env_timeout_s}")


def first_tokens(
    tokenizer: Tokenizer, obs: Observation, chat: ChatFormat | None = None
) -> tuple[list[int], list[Message] | None]:
    """The first observation's tokens (the prompt) and, for chat observations (all of them under ``chat``), the
    message history."""
    if isinstance(obs, str) and chat is None:
        return tokenizer.encode(obs), None
    messages = chat.first(obs) if chat is not None else list(obs)
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False), messages


def observation_tokens(
    tokenizer: Tokenizer,
    obs: Observation,
    history: list[Message] | None,
    turn_text: str,
    ended_on_eos: bool,
    chat: ChatFormat | None = None,
) -> tuple[list[int], list[Message] | None]:
    """Tokens of an observation answering a turn (appended after the turn's sampled tokens), and the message history
    after it (see the module docstring)."""
    if chat is not None and history is not None:
        obs = chat.later(obs)
    if isinstance(obs, str):
        return tokenizer.encode(obs, add_special_tokens=False), history
    if history is None:
        raise ValueError("chat observation after a raw-text first observation: an episode keeps one kind")
    return tokenizer.encode(chat_suffix(tokenizer, history, turn_text, ended_on_eos, obs), add_special_tokens=False), [
        *history,
        {"role": "assistant", "content": turn_text},
        *obs,
    ]


def chat_suffix(
    tokenizer: Tokenizer, history: list[Message], turn_text: str, ended_on_eos: bool, new: list[Message]
) -> str:
    """The text that follows the model's turn when messages ``new`` answer it (module docstring)."""
    turn = {"role": "assistant", "content": turn_text}
    opened = tokenizer.apply_chat_template(history)
    closed = tokenizer.apply_chat_template([*history, turn], add_generation_prompt=False)
    full = tokenizer.apply_chat_template([*history, turn, *new])
    if not closed.startswith(opened + turn_text) or not full.startswith(closed):
        raise ValueError("the chat template is not append-only (it rewrites earlier turns or trims the model's text)")
    closing = closed[len(opened) + len(turn_text) :]
    eos = tokenizer.eos_token or ""
    if ended_on_eos and eos and closing.startswith(eos):
        closing = closing[len(eos) :]  # the model sampled it: its token is already in the episode
    return closing + full[len(closed) :]


def has_drift(tokenizer: Tokenizer, token_ids: Sequence[int]) -> bool:
    """Whether re-tokenising the episode's decoded text gives other tokens than those sampled and fed."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False) != list(token_ids)


def episode_batch(episodes: list[Episode], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors of the episodes (module docstring): ``input_ids``, ``labels``, ``mask``,
    ``engine_logprobs`` (0 off the mask) and ``turn_rewards``, all (B, T); ``prompt_lens`` and ``completion_lens``
    (B,): the first observation's length and the rest."""
    episodes = [e if len(e.token_ids) >= 2 else _empty_row(e, pad_id) for e in episodes]  # failed at reset
    width = max(len(e.token_ids) for e in episodes)  # T + 1
    tokens, mask, engine, rewards = [], [], [], []
    for e in episodes:
        n, pad = len(e.token_ids), width - len(e.token_ids)
        tokens.append(list(e.token_ids) + [pad_id] * pad)
        mask.append([float(m) for m in e.mask[1:]] + [0.0] * pad)  # label i is token i + 1
        engine.append(list(e.engine_logprobs[1:]) + [0.0] * pad)
        rewards.append(_reward_row(e, width - 1))
        assert n == len(e.mask) == len(e.engine_logprobs)
    ids = torch.tensor(tokens, dtype=torch.long)
    return {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "mask": torch.tensor(mask, dtype=torch.float32),
        "engine_logprobs": torch.tensor(engine, dtype=torch.float32),
        "turn_rewards": torch.tensor(rewards, dtype=torch.float32),
        "prompt_lens": torch.tensor([e.prompt_len for e in episodes]),
        "completion_lens": torch.tensor([len(e.token_ids) - e.prompt_len for e in episodes]),
    }


def _reward_row(e: Episode, width: int) -> list[float]:
    """The episode's turn rewards at their label positions (a turn that sampled nothing: at the sampled token
    before it, or nowhere when there is none); all 0 for a failed episode (it is not trained on)."""
    row = [0.0] * width
    if e.failed:
        return row
    for end, r in zip(e.turn_ends, e.turn_rewards):
        while end > 0 and not e.mask[end]:
            end -= 1
        if end > 0:
            row[end - 1] += r
    return row


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Figures to log per step: counts of failed, truncated and drifting episodes, mean turns and reward of the
    episodes that did not fail."""
    ok = [e for e in episodes if not e.failed]
    return {
        "episodes": float(len(episodes)),
        "episodes_failed": float(len(episodes) - len(ok)),
        "episodes_truncated": float(sum(e.truncated for e in ok)),
        "episodes_drift": float(sum(e.drift for e in ok)),
        "turns_mean": sum(e.num_turns for e in ok) / max(1, len(ok)),
        "episode_reward_mean": sum(e.reward for e in ok) / max(1, len(ok)),
    }


def _empty_row(e: Episode, pad_id: int) -> Episode:
    """A failed episode with no tokens as a row of two pads that nothing is trained on (the batch keeps its
    group-major layout)."""
    return Episode(e.env_index, e.sample_index, e.env_seed, token_ids=[pad_id, pad_id], mask=[0, 0],
                   engine_logprobs=[0.0, 0.0], prompt_len=1, failed=True, error=e.error)  # fmt: skip


def episode_rewards(episodes: list[Episode], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards (B,), keep (B,)): a failed episode is left out of the loss (keep 0) and takes the mean reward of
    its group's other episodes, so that it moves neither their advantages' mean nor its own."""
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32).view(-1, group_size)
    ok = torch.tensor([not e.failed for e in episodes], dtype=torch.float32).view(-1, group_size)
    mean = (rewards * ok).sum(1, keepdim=True) / ok.sum(1, keepdim=True).clamp(min=1)
    return torch.where(ok > 0, rewards, mean).flatten(), ok.flatten()


def mean_info(episodes: list[Episode]) -> dict[str, float]:
    """The mean of each ``info`` figure over the episodes that report it, and the mean number of turns."""
    sums: dict[str, list[float]] = {}
    for e in episodes:
        for key, value in e.info.items():
            sums.setdefault(key, []).append(value)
    means = {key: sum(values) / len(values) for key, values in sums.items()}
    return {**means, "turns": sum(e.num_turns for e in episodes) / max(1, len(episodes))}
