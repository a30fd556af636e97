"""The per-token outputs a one-process learner's loss sees (:class:`~spinwheel.parallel.token_outputs.TokenOutputs`),
by the cheapest exact layout of its rows, the output layer a chunk of positions at a time (never the whole
(rows × tokens × vocab) logits):

* rollout rows that say where their prompts end (``prompt_lens``, ``completion_lens``): each distinct prompt run once
  for the completions that share it (:func:`~spinwheel.train.shared_prompts.shared_prompt_outputs`) where a FLOP
  estimate says that is cheaper, else the rows packed without padding (:func:`~spinwheel.train.packing.packed_outputs`);
* other rows: one plain right-padded forward.

Reference: the plain forward with log-softmax over the full logits (``tests/test_chunked_logprobs.py``,
``tests/test_packing.py``, ``tests/test_rl_llm.py``).
"""

from __future__ import annotations

from torch import nn

from spinwheel.parallel.chunked_logprobs import chunked_token_logprobs
from spinwheel.parallel.token_outputs import TokenOutputs, is_scalar_head
from spinwheel.parallel.trainer import Batch
from spinwheel.train.packing import RowSpans, packed_outputs
from spinwheel.train.shared_prompts import PACKING_MARGIN, SharedPrompts, plain_cost, shared_prompt_outputs


def local_outputs(model: nn.Module, batch: Batch, entropy: bool, temperature: float = 1.0) -> TokenOutputs:
    """The per-token outputs of ``batch``'s rows under the policy that samples at temperature T (logits / T)."""
    if is_scalar_head(model.config):
        return TokenOutputs(values=model(batch["input_ids"])[..., 0].float())
    if "prompt_lens" in batch and "completion_lens" in batch:
        spans = RowSpans.of(batch)
        packed_cost = sum(plain_cost(model.config, 1, n) for n in spans.ends)
        shared = SharedPrompts.of(batch)
        if shared is not None and shared.cost(model.config) < PACKING_MARGIN * packed_cost:
            return shared_prompt_outputs(model, batch, shared, entropy, temperature)
        return packed_outputs(model, batch, spans, entropy, temperature)
    hidden = model(batch["input_ids"], return_hidden=True)  # (B, T, C)
    logp, ent = chunked_token_logprobs(hidden, model.lm_head, batch["labels"], temperature=temperature, entropy=entropy)
    return TokenOutputs(logprobs=logp, entropy=ent)
