"""Plain (non-paged) batched generation: the simple reference the serving engine is checked against, and a
fallback for quick evaluation. Each step re-runs the whole left-padded batch (no KV cache), so it is only for
small models and short outputs.
"""

from __future__ import annotations

import torch

from spinwheel.models.transformer import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int = 0,
    temperature: float = 0.0,
    seed: int | None = None,
    batch_size: int = 256,
) -> list[list[int]]:
    """Complete each prompt (token ids) with up to ``max_new_tokens`` tokens; greedy when ``temperature == 0``.

    Returns the new tokens of each prompt, stopping after (and excluding) ``eos_id``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (add a BOS token to empty prompts)")
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        out.extend(
            _generate_batch(
                model, prompts[start : start + batch_size], max_new_tokens, eos_id, pad_id, temperature, gen
            )
        )
    model.train(was_training)
    return out


def _generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int,
    temperature: float,
    gen: torch.Generator | None,
) -> list[list[int]]:
    device = model.device
    b, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, longest), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((b, longest), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):  # left padding: every row's next token is at the last column
        ids[i, longest - len(p) :] = torch.tensor(p, device=device)
        mask[i, longest - len(p) :] = 1
    done = torch.zeros(b, dtype=torch.bool, device=device)
    new_tokens = []
    for _ in range(max_new_tokens):
        logits = model(ids, attention_mask=mask)[:, -1].float()  # (B, V)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        new_tokens.append(nxt)
        if eos_id is not None:
            done |= nxt == eos_id
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # finished rows' tokens are discarded
    tokens = torch.stack(new_tokens, dim=1).tolist()
    result = []
    for row in tokens:
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        result.append(row)
    return result
