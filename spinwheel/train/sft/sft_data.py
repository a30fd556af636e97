"""SFT data: tokenized examples (built-in arithmetic task or JSONL), the step's batch as a pure function of the
seed and the step (so resuming needs no sampler state), right-padded collation, and the completion-only loss
written out as the formula (the reference the trainer's weighted NLL is tested against).

A ``segments`` record (a multi-turn episode, e.g. an environment's expert trace from ``spinwheel envs expert``) is
tokenized as the RL rollout builds an episode: each segment on its own, concatenated — the leading environment
segments form the prompt (BOS before the first), then every later segment without special tokens, EOS after the
last model segment (environment segments after it are dropped: nothing follows EOS). The loss mask is 1 on the
model segments' tokens and that EOS, 0 on the environment's. Held-out, a generated completion is scored against
the first model segment: exact match where it is the episode's only model turn, else the completion must start
with it (the rest of the episode needs the environment; ``--max-new-tokens`` must cover the first turn).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spinwheel.envs.chat import ChatFormat, resolve_chat
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.tasks.arithmetic import ArithmeticTask, reward
from spinwheel.tasks.data import describe_skipped, read_sft_jsonl
from spinwheel.train.sft.sft_config import SFTConfig


@dataclass(frozen=True)
class SFTExample:
    """A tokenized example: ``prompt_ids`` (with BOS) then ``completion_ids`` (with EOS); ``reference`` is what a
    generated completion is scored against."""

    prompt: str
    reference: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    completion_mask: tuple[float, ...] | None = None  # loss weight of each completion token; None: all 1

    @property
    def loss_mask(self) -> tuple[float, ...]:
        return self.completion_mask if self.completion_mask is not None else (1.0,) * len(self.completion_ids)

    @property
    def answer(self) -> str:  # the name task evaluation reads
        return self.reference


def exact_match(completion: str, reference: str) -> float:
    return float(completion.strip() == reference.strip())


def first_turn_match(completion: str, reference: str) -> float:
    """A multi-turn episode's first model turn: the completion starts with it (the rest needs the environment)."""
    return float(bool(reference) and completion.lstrip().startswith(reference.lstrip()))


@dataclass
class SFTData:
    train: list[SFTExample]
    eval: list[SFTExample]
    score: Callable[[str, str], float]  # (generated completion, reference) -> 0..1
    num_dropped: int = 0
    dropped_message: str = ""  # one line counting the dropped examples and naming where they are ("" if none)


# (prompt text, prompt ids, reference completion, where: "path:line" or the task split and index, and for a segments
# record the (text, is the model's) segments after the prompt, up to the last model segment; None otherwise)
_Row = tuple[str, list[int], str, str, "list[tuple[str, bool]] | None"]


def _segments_row(tokenizer: Tokenizer, segments: list[tuple[str, bool]], where: str) -> _Row:
    """A segments record's row: the leading environment segments as the prompt (BOS first, each segment tokenized
    on its own), the first model segment as the reference, the rest up to the last model segment."""
    first = next(i for i, (_, model) in enumerate(segments) if model)
    last = max(i for i, (_, model) in enumerate(segments) if model)
    ids = tokenizer.encode(segments[0][0] if first else "")
    for text, _ in segments[1:first]:
        ids += tokenizer.encode(text, add_special_tokens=False)
    prompt = "".join(text for text, _ in segments[:first])
    return prompt, ids, segments[first][0], where, segments[first : last + 1]


def _prompt_row(tokenizer: Tokenizer, prompt: str, chat: ChatFormat | None) -> tuple[str, list[int]]:
    """A plain prompt's (text, ids): with BOS, or under ``--chat`` the user's turn rendered with the template (the
    system prompt first; the completion then ends with EOS, the template's end of turn for ChatML)."""
    if chat is None:
        return prompt, tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template(chat.first(prompt), add_generation_prompt=True)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _read_rows(config: SFTConfig, tokenizer: Tokenizer) -> tuple[list[_Row], list[_Row]]:
    """(train, held-out) rows of the built-in task or ``config.data``. Raw prompts get the tokenizer's special
    tokens (BOS); chat-rendered prompts already carry them, as HF chat templates write BOS themselves."""
    chat = resolve_chat(config.chat, tokenizer, config.system_prompt)
    if config.data is None:
        task = ArithmeticTask(config.task)
        return tuple(  # type: ignore[return-value]
            [
                (*_prompt_row(tokenizer, e.prompt, chat), e.answer, f"{split} example {i}", None)
                for i, e in enumerate(examples)
            ]
            for split, examples in (("train", task.train), ("test", task.test))
        )
    rows: list[_Row] = []
    for r in read_sft_jsonl(config.data):
        if r.segments is not None:
            rows.append(_segments_row(tokenizer, r.segments, r.where))
        elif r.messages is not None:
            messages = chat.first(r.messages[:-1]) if chat is not None else r.messages[:-1]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            rows.append((prompt, ids, r.messages[-1]["content"], r.where, None))
        else:
            assert r.prompt is not None and r.completion is not None
            rows.append((*_prompt_row(tokenizer, r.prompt, chat), r.completion, r.where, None))
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(config.seed)).tolist()
    num_eval = max(1, int(len(rows) * config.eval_fraction)) if len(rows) > 1 else 0
    return [rows[i] for i in order[num_eval:]], [rows[i] for i in order[:num_eval]]


def build_data(config: SFTConfig, tokenizer: Tokenizer, max_context: int | None = None) -> SFTData:
    """Tokenize the built-in arithmetic task or ``config.data``. Examples longer than ``max_seq_len`` are dropped,
    and with ``max_context`` (the model's ``max_position_embeddings``) those longer than it or whose prompt leaves
    no room for ``max_new_tokens`` at evaluation; ``dropped_message`` counts them and names where they are."""
    if tokenizer.eos_id is None:
        raise ValueError("the tokenizer has no EOS token; SFT needs one to teach the model to stop")
    rows_train, rows_eval = _read_rows(config, tokenizer)
    score = _score(config, rows_train + rows_eval)
    limit = config.max_seq_len if max_context is None else min(config.max_seq_len, max_context)
    prompt_room = limit if max_context is None else max_context - config.max_new_tokens
    dropped: list[str] = []

    def tokenize(rows: list[_Row]) -> list[SFTExample]:
        out = []
        for p, p_ids, c, where, rest in rows:
            c_ids, c_mask = _completion(tokenizer, c, rest)
            if len(p_ids) + len(c_ids) > limit or len(p_ids) > prompt_room:
                dropped.append(f"{where} ({len(p_ids)} + {len(c_ids)} tokens)")
                continue
            out.append(SFTExample(p, c, tuple(p_ids), c_ids, c_mask))
        return out

    train, evaluation = tokenize(rows_train), tokenize(rows_eval)
    why = f"longer than --max-seq-len {config.max_seq_len}"
    if max_context is not None:
        why += f" or not fitting the model's context of {max_context} with --max-new-tokens {config.max_new_tokens}"
    shown = describe_skipped(dropped, "examples", why).partition(": ")[2]
    message = f"dropped {len(dropped)} examples {why}: {shown}" if dropped else ""
    if not train:
        raise ValueError(f"no training examples left ({message}); raise --max-seq-len or check --data")
    return SFTData(train, evaluation, score, len(dropped), message)


def _completion(
    tokenizer: Tokenizer, reference: str, rest: list[tuple[str, bool]] | None
) -> tuple[tuple[int, ...], tuple[float, ...] | None]:
    """(completion ids with EOS, their loss mask: None for a plain completion, trained on every token)."""
    eos = tokenizer.eos_id
    assert eos is not None
    if rest is None:
        return tuple(tokenizer.encode(reference, add_special_tokens=False)) + (eos,), None
    ids: list[int] = []
    mask: list[float] = []
    for text, model in rest:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [1.0 if model else 0.0] * len(piece)
    return (*ids, eos), (*mask, 1.0)


def _score(config: SFTConfig, rows: list[_Row]) -> Callable[[str, str], float]:
    """The held-out score: the task's reward, exact match, and for multi-turn segments records (more than one model
    segment) :func:`first_turn_match` against their first model turn."""
    if config.data is None:
        return reward
    multi_turn = {c for _, _, c, _, rest in rows if rest is not None and sum(m for _, m in rest) > 1}
    if not multi_turn:
        return exact_match
    return lambda completion, ref: (first_turn_match if ref in multi_turn else exact_match)(completion, ref)


def batch_indices(step: int, batch_size: int, num_examples: int, seed: int) -> list[int]:
    """Indices of the examples in step ``step``'s batch: consecutive slices of one seeded permutation per epoch."""
    out: list[int] = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_examples)
        perm = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        take = min(batch_size - len(out), num_examples - offset)
        out.extend(perm[offset : offset + take].tolist())
    return out


def collate(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids`` (B, T) and ``loss_mask`` (B, T-1), token t+1's completion mask (1 on a
    completion token, 0 on an environment segment's token in a segments example) and 0 elsewhere.

    With right padding, causal attention never lets a real token see a pad, so no attention mask is needed.
    """
    seqs = [e.prompt_ids + e.completion_ids for e in examples]
    t = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), t - 1), dtype=torch.float32)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        # Targets input_ids[:, 1:]; the completion's first token is predicted at position len(prompt) - 1.
        loss_mask[i, len(e.prompt_ids) - 1 : len(s) - 1] = torch.tensor(e.loss_mask)
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def completion_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean next-token cross-entropy over completion tokens.

    logits (B, T, V), input_ids (B, T), loss_mask (B, T-1) -> scalar loss and stats (``num_tokens``).
    """
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    num_tokens = loss_mask.sum()
    loss = (nll * loss_mask.flatten()).sum() / num_tokens.clamp(min=1)
    return loss, {"num_tokens": float(num_tokens)}


def trainer_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collated batch as the trainer takes it: inputs and labels shifted by one, and per-token weights
    ``loss_mask / Σ loss_mask`` over the whole (global) batch, so the weighted NLL is :func:`completion_loss`."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "weights": mask / mask.sum().clamp(min=1)}
