"""Chunked log-probs and entropy (spinwheel/parallel/chunked_logprobs.py) against the full-logits computation:
values and gradients (hidden states and a trained head) to 1e-5 in fp32, with the learner's temperature."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.models.transformer import token_logprobs
from spinwheel.parallel.chunked_logprobs import chunk_rows, chunked_token_logprobs


def reference(hidden, head, labels, temperature):
    logits = head(hidden)
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits.float(), dim=-1)
    return token_logprobs(logits, labels), -(logp_all.exp() * logp_all).detach().sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1, 5, 64])  # 5 does not divide the 3·7 = 21 positions: a short last chunk
def test_values_and_gradients_equal_full_logits(temperature, rows):
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=gen))
    hidden = torch.randn(3, 7, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7), generator=gen)
    upstream = torch.randn(3, 7, generator=gen)  # a loss that weighs every token differently

    ref_logp, ref_ent = reference(hidden, head, labels, temperature)
    (ref_logp * upstream).sum().backward()
    ref_gh, ref_gw = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    logp, ent = chunked_token_logprobs(hidden, head, labels, temperature=temperature, entropy=True, rows=rows)
    (logp * upstream).sum().backward()
    assert logp.shape == ent.shape == (3, 7)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad  # detached, as TokenOutputs has it
    torch.testing.assert_close(hidden.grad, ref_gh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.weight.grad, ref_gw, rtol=1e-5, atol=1e-5)
    assert float(ref_gw.abs().max()) > 1e-2  # the comparison is not of zeros


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_frozen_head_gradient_from_the_forward_equals_full_logits(temperature):
    """LoRA's tied embedding is frozen: the hidden states' gradient comes from rows kept in the forward."""
    gen = torch.Generator().manual_seed(1)
    head = nn.Linear(8, 30, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(30, 8, generator=gen))
    hidden = torch.randn(10, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 30, (10,), generator=gen)
    upstream = torch.randn(10, generator=gen)
    ref_logp, _ = reference(hidden, head, labels, temperature)
    (ref_logp * upstream).sum().backward()
    ref_gh, hidden.grad = hidden.grad.clone(), None
    logp, ent = chunked_token_logprobs(hidden, head, labels, temperature=temperature, rows=3)
    assert ent is None
    (logp * upstream).sum().backward()
    assert head.weight.grad is None
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_gh, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        again, _ = chunked_token_logprobs(hidden, head, labels, temperature=temperature, rows=4)
    torch.testing.assert_close(again, logp.detach())


def test_chunk_rows_bounds_the_chunk_and_bad_input_is_refused():
    assert chunk_rows(49_152, 32 * 2**20) == 170  # 170 rows × 49,152 × 4 B ≈ 32 MiB
    assert chunk_rows(10**9) == 1
    with pytest.raises(ValueError, match="without bias"):
        chunked_token_logprobs(torch.randn(2, 4), nn.Linear(4, 6), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_token_logprobs(
            torch.randn(2, 4), nn.Linear(4, 6, bias=False), torch.zeros(2, dtype=torch.long), temperature=0
        )
