"""SFT data: tokenized examples (built-in arithmetic task or JSONL), the step's batch as a pure function of the
seed and the step (so resuming needs no sampler state), right-padded collation, and the completion-only loss
written out as the formula (the reference the trainer's weighted NLL is tested against)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spinwheel.models.tokenizer import Tokenizer
from spinwheel.tasks.arithmetic import ArithmeticTask, reward
from spinwheel.tasks.data import describe_skipped, read_sft_jsonl
from spinwheel.train.sft_config import SFTConfig


@dataclass(frozen=True)
class SFTExample:
    """A tokenized example: ``prompt_ids`` (with BOS) then ``completion_ids`` (with EOS); ``reference`` is what a
    generated completion is scored against."""

    prompt: str
    reference: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]

    @property
    def answer(self) -> str:  # the name task evaluation reads
        return self.reference


def exact_match(completion: str, reference: str) -> float:
    return float(completion.strip() == reference.strip())


@dataclass
class SFTData:
    train: list[SFTExample]
    eval: list[SFTExample]
    score: Callable[[str, str], float]  # (generated completion, reference) -> 0..1
    num_dropped: int = 0
    dropped_message: str = ""  # one line counting the dropped examples and naming where they are ("" if none)


# (prompt text, prompt ids, reference completion, where: "path:line" or the task split and index)
_Row = tuple[str, list[int], str, str]


def _read_rows(config: SFTConfig, tokenizer: Tokenizer) -> tuple[list[_Row], list[_Row]]:
    """(train, held-out) rows of the built-in task or ``config.data``. Raw prompts get the tokenizer's special
    tokens (BOS); chat-rendered prompts already carry them, as HF chat templates write BOS themselves."""
    if config.data is None:
        task = ArithmeticTask(config.task)
        return tuple(  # type: ignore[return-value]
            [(e.prompt, tokenizer.encode(e.prompt), e.answer, f"{split} example {i}") for i, e in enumerate(examples)]
            for split, examples in (("train", task.train), ("test", task.test))
        )
    rows = []
    for r in read_sft_jsonl(config.data):
        if r.messages is not None:
            prompt = tokenizer.apply_chat_template(r.messages[:-1], add_generation_prompt=True)
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            rows.append((prompt, ids, r.messages[-1]["content"], r.where))
        else:
            assert r.prompt is not None and r.completion is not None
            rows.append((r.prompt, tokenizer.encode(r.prompt), r.completion, r.where))
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
    score: Callable[[str, str], float] = reward if config.data is None else exact_match
    limit = config.max_seq_len if max_context is None else min(config.max_seq_len, max_context)
    prompt_room = limit if max_context is None else max_context - config.max_new_tokens
    dropped: list[str] = []

    def tokenize(rows: list[_Row]) -> list[SFTExample]:
        completions = tokenizer.encode_batch([c for _, _, c, _ in rows], add_special_tokens=False)
        out = []
        for (p, p_ids, c, where), c_ids in zip(rows, completions):
            if len(p_ids) + len(c_ids) + 1 > limit or len(p_ids) > prompt_room:
                dropped.append(f"{where} ({len(p_ids)} + {len(c_ids) + 1} tokens)")
                continue
            out.append(SFTExample(p, c, tuple(p_ids), tuple(c_ids) + (tokenizer.eos_id,)))  # type: ignore[operator]
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
    """Right-padded batch: ``input_ids`` (B, T) and ``loss_mask`` (B, T-1), 1 where token t+1 is a completion token.

    With right padding, causal attention never lets a real token see a pad, so no attention mask is needed.
    """
    seqs = [e.prompt_ids + e.completion_ids for e in examples]
    t = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), t - 1), dtype=torch.float32)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        # Targets input_ids[:, 1:]; the completion's first token is predicted at position len(prompt) - 1.
        loss_mask[i, len(e.prompt_ids) - 1 : len(s) - 1] = 1.0
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
