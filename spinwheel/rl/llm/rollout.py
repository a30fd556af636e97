"""The rollout's shared pieces: prompts, the sampling seeds, the data-parallel share of a step and its gather, and
the right-padded token batch of one-step rollouts (the samples themselves are episodes:
:mod:`~spinwheel.rl.llm.episodes`, :mod:`~spinwheel.rl.llm.prompts_env`).

Seeds: request ``(step, prompt p)`` is sampled with seed ``sample_seed(run seed, step, p)`` and the engine derives
sample j's generator from (that seed, j) — so each completion is a function of (run seed, step, prompt index,
sample index) and of the weights only, not of which rank or batch generated it. Under ``torchrun`` every
data-parallel rank generates its own share of the prompts with its own engine and the shares are exchanged, so
every rank holds the global rollout batch (what the trainer takes).

Batch layout, row ``i = p·G + j`` (prompt p, sample j), right-padded to the longest row::

    tokens     <bos> 1 2 + 3 4 = 4 6 <eos> <pad>
    input_ids  <bos> 1 2 + 3 4 = 4 6              (T = longest prompt+completion − 1)
    labels           1 2 + 3 4 = 4 6 <eos>
    mask             0 0 0 0 0 0 1 1 1             1 where the label is a completion token
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from spinwheel.models.tokenizer import Tokenizer
from spinwheel.parallel.mesh import ParallelDims

T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: tuple[int, ...]  # tokenized with the tokenizer's special tokens (BOS)
    answer: str
    record: Any = field(default=None, compare=False, repr=False)  # its --data line (columns, chat messages)

    @property
    def prompt(self) -> str:  # the names task evaluation reads
        return self.text


@dataclass
class Rollout:
    """The global rollout batch, rows prompt-major (``i = p·G + j``)."""

    prompts: list[Prompt]  # the step's P prompts
    group_size: int
    completion_ids: list[list[int]]  # (B) token ids, EOS included when the completion stopped on it
    engine_logprobs: list[list[float]]  # (B) the engine's log-prob of each sampled token (tempered)
    texts: list[str]  # (B) decoded completions

    @property
    def row_prompts(self) -> list[Prompt]:
        return [p for p in self.prompts for _ in range(self.group_size)]


def sample_seed(seed: int, step: int, prompt_index: int) -> int:
    """The sampling seed of prompt ``prompt_index`` of rollout step ``step`` (a pure function, see the docstring)."""
    return (seed * 1_000_003 + step) * 1_000_033 + prompt_index


def dp_share(num_items: int, dims: ParallelDims | None) -> tuple[int, int]:
    """(first, count) of this data-parallel rank's contiguous share of ``num_items`` (the last shares may be
    shorter, or empty)."""
    dp_size = dims.dp_axis.size if dims is not None else 1
    dp_rank = dims.dp_axis.rank if dims is not None else 0
    share = -(-num_items // dp_size)
    first = min(dp_rank * share, num_items)
    return first, min(share, num_items - first)


def gather_dp(mine: T, dims: ParallelDims | None) -> list[T]:
    """Every data-parallel rank's ``mine``, in dp-rank order, on every rank (a collective over the world; the
    tensor/pipeline peers of a dp rank hold the same share: one is kept)."""
    if dims is None or dims.dp_axis.size == 1:
        return [mine]
    import torch.distributed as dist

    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dims.dp_axis.rank, mine))
    by_dp: dict[int, T] = {}
    for r, part in gathered:  # type: ignore[misc]
        by_dp.setdefault(r, part)
    return [by_dp[r] for r in range(dims.dp_axis.size)]


def rollout_batch(rollout: Rollout, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors of the rollout (see the module docstring): ``input_ids``, ``labels``, ``mask`` and
    ``engine_logprobs`` (0 off the mask), all (B, T); ``prompt_lens`` and ``completion_lens`` (B,), with which a
    one-process learner runs each group's shared prompt once."""
    prompts, comps = rollout.row_prompts, rollout.completion_ids
    width = max(len(p.ids) + len(c) for p, c in zip(prompts, comps))  # T + 1
    tokens_rows, mask_rows, engine_rows = [], [], []
    for p, c, lp in zip(prompts, comps, rollout.engine_logprobs):  # rows as lists, one tensor each at the end
        n, pad = len(p.ids), width - len(p.ids) - len(c)
        tokens_rows.append([*p.ids, *c] + [pad_id] * pad)
        # label at position n-1 is the first completion token
        mask_rows.append([0.0] * (n - 1) + [1.0] * len(c) + [0.0] * pad)
        engine_rows.append([0.0] * (n - 1) + list(lp) + [0.0] * (width - n - len(lp)))
    tokens = torch.tensor(tokens_rows, dtype=torch.long)
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    engine = torch.tensor(engine_rows, dtype=torch.float32)
    prompt_lens = torch.tensor([len(p.ids) for p in prompts])
    completion_lens = torch.tensor([len(c) for c in comps])
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "mask": mask,
        "engine_logprobs": engine,
        "prompt_lens": prompt_lens,
        "completion_lens": completion_lens,
    }


def prompts_from_task(tokenizer: Tokenizer, examples) -> list[Prompt]:
    """Prompts from task examples (anything with ``prompt`` and ``answer``), tokenized with BOS."""
    ids = tokenizer.encode_batch([e.prompt for e in examples])
    return [Prompt(e.prompt, tuple(i), str(e.answer)) for e, i in zip(examples, ids)]
