"""The per-token outputs a one-process learner's loss sees (:class:`~spinwheel.parallel.token_outputs.TokenOutputs`),
by the cheapest exact layout of its rows, the output layer a chunk of positions at a time (never the whole
(rows × tokens × vocab) logits):

* ``"shared"``: rollout rows that say where their prompts end (``prompt_lens``, ``completion_lens``), each distinct
  prompt run once for the completions that share it (:func:`~spinwheel.train.shared_prompts.shared_prompt_outputs`),
  where a FLOP estimate says that is cheaper than
* ``"packed"``: those rows packed without padding (:func:`~spinwheel.train.packing.packed_outputs`);
* ``"plain"``: other rows, one right-padded forward; ``"values"``: a scalar-head model's (critic, reward model).

The layout is chosen once for a batch (:func:`choose_layout`), and the learner's token-budget micro-batches are cut by
what that layout runs (:func:`micro_batch_plan`). Reference: the plain forward with log-softmax over the full logits
(``tests/test_chunked_logprobs.py``, ``tests/test_packing.py``, ``tests/test_rl_llm.py``).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from spinwheel.parallel.chunked_logprobs import chunked_token_logprobs
from spinwheel.parallel.token_outputs import TokenOutputs, is_scalar_head
from spinwheel.parallel.trainer import Batch
from spinwheel.train.packing import RowSpans, packed_outputs, plan_microbatches, shared_prefixes
from spinwheel.train.shared_prompts import PACKING_MARGIN, SharedPrompts, plain_cost, shared_prompt_outputs

Layout = Literal["shared", "packed", "plain", "values"]


def choose_layout(model: nn.Module, batch: Batch) -> Layout:
    """How :func:`local_outputs` runs ``batch`` (see the module docstring)."""
    if is_scalar_head(model.config):
        return "values"
    if "prompt_lens" not in batch or "completion_lens" not in batch:
        return "plain"
    packed_cost = sum(plain_cost(model.config, 1, n) for n in RowSpans.of(batch).ends)
    shared = SharedPrompts.of(batch)
    return "shared" if shared is not None and shared.cost(model.config) < PACKING_MARGIN * packed_cost else "packed"


def micro_batch_plan(batch: Batch, layout: Layout, budget: int) -> list[range]:
    """Consecutive rows in micro-batches of at most ``budget`` tokens as ``layout`` runs them (0: all at once)."""
    if layout in ("plain", "values"):
        return plan_microbatches([batch["input_ids"].shape[1]] * batch["input_ids"].shape[0], budget)
    shared = shared_prefixes(batch) if layout == "shared" else None
    return plan_microbatches(RowSpans.of(batch).ends, budget, shared)


def local_outputs(
    model: nn.Module, batch: Batch, entropy: bool, temperature: float = 1.0, layout: Layout | None = None
) -> TokenOutputs:
    """The per-token outputs of ``batch``'s rows under the policy that samples at temperature T (logits / T), in
    ``layout`` (default: :func:`choose_layout`'s)."""
    layout = layout or choose_layout(model, batch)
    if layout == "values":
        return TokenOutputs(values=model(batch["input_ids"])[..., 0].float())
    if layout == "shared" and (shared := SharedPrompts.of(batch)) is not None:
        return shared_prompt_outputs(model, batch, shared, entropy, temperature)
    if layout in ("shared", "packed"):  # "shared" rows without completions: nothing shares
        return packed_outputs(model, batch, RowSpans.of(batch), entropy, temperature)
    hidden = model(batch["input_ids"], return_hidden=True)  # (B, T, C)
    logp, ent = chunked_token_logprobs(hidden, model.lm_head, batch["labels"], temperature=temperature, entropy=entropy)
    return TokenOutputs(logprobs=logp, entropy=ent)
