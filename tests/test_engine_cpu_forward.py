"""The engine's CPU forward (oneDNN-packed weights, fused element-wise C kernels) against the model's own ops."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from spinwheel.engine import LLM, SamplingParams, model_runner
from spinwheel.engine.kernels import cpu_forward, cpu_kernels
from spinwheel.models import ModelConfig, Transformer
from spinwheel.models.transformer import RMSNorm, apply_rope


def _require_kernels() -> None:
    """Skip only where no C compiler exists; with a compiler, kernels that fail to build are a failure."""
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler for the fused CPU kernels")
    assert cpu_kernels.load_kernels() is not None, "a C compiler exists but the CPU kernels did not build"


def _require_onednn() -> None:
    """Skip only on PyTorch builds without oneDNN; with oneDNN, a packed linear that fails its probe is a failure."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    assert cpu_forward.onednn_linear_available(), "oneDNN is built in but its packed linear failed the probe"


def test_rms_norm_kernel_matches_module():
    _require_kernels()
    torch.manual_seed(0)
    for n, c in ((1, 16), (7, 512), (33, 40)):
        norm = RMSNorm(c, eps=1e-5)
        with torch.no_grad():
            norm.weight.normal_()
        x = torch.randn(n, c) * 3
        torch.testing.assert_close(
            cpu_kernels.rms_norm(x, norm.weight.detach(), norm.eps), norm(x).detach(), rtol=1e-6, atol=1e-6
        )
    with pytest.raises(ValueError, match="weight shape"):
        cpu_kernels.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_kernels.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6)


def test_silu_mul_kernel_matches_torch():
    _require_kernels()
    torch.manual_seed(0)
    for n, i in ((1, 16), (5, 1088), (3, 37)):  # vector body and scalar tail
        gu = torch.randn(n, 2 * i) * 6
        ref = F.silu(gu[:, :i]) * gu[:, i:]
        torch.testing.assert_close(cpu_kernels.silu_mul(gu), ref, rtol=2e-6, atol=1e-6)
    big = torch.tensor([[-200.0, -90.0, 0.0, 90.0] * 4 + [1.0] * 16])  # far tails: no inf or NaN
    torch.testing.assert_close(cpu_kernels.silu_mul(big), F.silu(big[:, :16]) * big[:, 16:])


@pytest.mark.parametrize("h,g,d", [(4, 2, 16), (8, 8, 64), (6, 1, 32)])
def test_rope_qkv_kernel_matches_model_rope_and_writes_cache(h, g, d):
    _require_kernels()
    torch.manual_seed(0)
    n, bs, blocks = 9, 4, 10
    qkv = torch.randn(n, (h + 2 * g) * d)
    pos = torch.randint(0, 500, (n,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos.float()[:, None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    k_cache, v_cache = torch.zeros(blocks, bs, g, d), torch.zeros(blocks, bs, g, d)
    slots = torch.randperm(blocks * bs)[:n]
    q, k, v = cpu_kernels.rope_qkv(qkv, h, g, cos, sin, k_cache, v_cache, slots)
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    q_ref, k_ref, v_ref = qkv.split([h * d, g * d, g * d], dim=1)
    q_ref = apply_rope(q_ref.reshape(1, n, h, d), full_cos, full_sin)[0]
    k_ref = apply_rope(k_ref.reshape(1, n, g, d), full_cos, full_sin)[0]
    torch.testing.assert_close(q, q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(v, v_ref.reshape(n, g, d), rtol=0, atol=0)
    torch.testing.assert_close(k_cache.view(-1, g, d)[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(-1, g, d)[slots], v, rtol=0, atol=0)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, g, d)[untouched].any() and not v_cache.view(-1, g, d)[untouched].any()
    with pytest.raises(ValueError, match="inconsistent shapes"):
        cpu_kernels.rope_qkv(qkv[:, 1:].contiguous(), h, g, cos, sin)


VARIANTS = {
    "llama-gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen2-bias-tied": dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3-qk-norm": dict(model_type="qwen3", qk_norm=True, head_dim=16),
    "mlp-bias-mha": dict(mlp_bias=True, attention_bias=True, num_key_value_heads=4),
}


def _model(**kw) -> Transformer:
    base = dict(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
    )
    base.update(kw)
    m = Transformer(ModelConfig(**base)).init_weights(seed=3, std=0.15)
    with torch.no_grad():  # non-trivial norms and biases, so every parameter shapes the output
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    return m


def _run(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0))
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch-ops"])
def test_packed_forward_matches_model_forward(name, kernels, monkeypatch):
    _require_onednn()
    if kernels:
        _require_kernels()
    else:
        monkeypatch.setattr(model_runner, "load_kernels", lambda: None)
    m = _model(**VARIANTS[name])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 120, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 3)]
    fast = LLM(
        m, block_size=4, max_num_batched_tokens=32, max_num_seqs=8
    )  # chunked prefill + decodes mixed in one step
    assert fast.engine.runner.packed is not None and fast.engine.runner.fused_decode == kernels
    ref = LLM(
        m, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, cpu_packed_weights=False
    )  # the model's own forward
    assert ref.engine.runner.packed is None
    ids_fast, lp_fast = _run(fast, prompts)
    ids_ref, lp_ref = _run(ref, prompts)
    assert ids_fast == ids_ref
    for a, b in zip(lp_fast, lp_ref):
        torch.testing.assert_close(
            torch.tensor([list(d.values())[0] for d in a]),
            torch.tensor([list(d.values())[0] for d in b]),
            rtol=1e-4,
            atol=1e-4,
        )


def test_packed_weights_follow_in_place_updates():
    """A trainer sharing the model changes parameters in place: the next step repacks (version counters)."""
    _require_onednn()
    m = _model()
    llm = LLM(m, block_size=4, enable_prefix_caching=False)
    prompt = list(range(10, 30))
    before = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    other = _model(**{})
    with torch.no_grad():
        other.layers[0].mlp.down_proj.weight.normal_(0, 0.3)
        other.lm_head.weight.normal_(0, 0.3)
        for p, q in zip(m.parameters(), other.parameters()):
            p.copy_(q)  # in place, no update_weights call
    after = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    expect = (
        LLM(other, block_size=4, cpu_packed_weights=False)
        .generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
        .outputs[0]
        .token_ids
    )
    assert after == expect and after != before
    # nothing changed since: no repacking
    assert llm.engine.runner.packed.refresh() == 0
