"""Held-out evaluation with greedy decoding, on the serving engine over the trained weights (no copy) or on the
plain reference generate loop; scored by the task's own :func:`spinwheel.tasks.arithmetic.evaluate`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spinwheel.models.generate import generate
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.tasks.arithmetic import evaluate
from spinwheel.train.sft.sft_data import SFTData

Generate = Callable[[list[list[int]], int], list[str]]  # (prompt ids, max new tokens) -> completions


def plain_generate(model: Transformer, tokenizer: Tokenizer) -> Generate:
    """Greedy completions with the plain (non-paged) reference loop."""

    def run(prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        out = generate(model, prompts, max_new_tokens, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id or 0)
        return [tokenizer.decode(o) for o in out]

    return run


def engine_generate(model: Transformer, tokenizer: Tokenizer, max_model_len: int) -> Generate:
    """Greedy completions with the serving engine over the trained model's own weights (no copy). The engine's
    paged kernels fall back to dense attention for training forwards; the prefix cache is dropped before each
    evaluation because the weights changed since the last one."""
    from spinwheel.engine import LLM, SamplingParams

    llm = LLM(model, tokenizer, max_model_len=max_model_len)

    def run(prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        llm.update_weights(model)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
        return [o.outputs[0].text for o in outs]

    return run


def heldout_eval(generate_fn: Generate, data: SFTData, num_examples: int, max_new_tokens: int) -> dict[str, Any]:
    """Held-out score with greedy decoding: mean of ``data.score`` and a few (prompt, completion, reference)."""
    examples = data.eval[:num_examples]
    if not examples:
        return {"exact_match": None, "samples": []}
    ids = {e.prompt: list(e.prompt_ids) for e in examples}
    result = evaluate(
        lambda prompts: generate_fn([ids[p] for p in prompts], max_new_tokens),
        examples,
        batch_size=len(examples),
        score=data.score,
    )
    return {"exact_match": result.exact_match, "samples": result.samples}
