"""The engine's oneDNN-packed CPU path over a model carrying a trainer's LoRA layers: it packs the merged weight
W + s B A per projection and re-merges when the adapters change; its outputs equal the unmerged path's (the model's
own forward through :class:`LoRALinear`) to fp32 rounding."""

import copy

import pytest
import torch

from spinwheel.engine import LLM, SamplingParams
from spinwheel.engine.kernels import cpu_forward
from spinwheel.models import ModelConfig, Transformer
from spinwheel.models.lora import LoRAConfig, adapters_disabled, apply_lora, lora_parameters

PROMPTS = [[5, 17, 3, 99], list(range(10, 31)), [7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
ENGINE = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False)


def _require_onednn() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    assert cpu_forward.onednn_linear_available(), "oneDNN is built in but its packed linear failed the probe"


def _lora_model(targets: str = "all-linear", **kw) -> Transformer:
    cfg = dict(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
    )
    cfg.update(kw)
    m = Transformer(ModelConfig(**cfg)).init_weights(seed=3, std=0.15)
    apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=targets), seed=1)
    _perturb_adapters(m, seed=2, std=0.2)  # B != 0: the adapters change the outputs
    return m


@torch.no_grad()
def _perturb_adapters(m: Transformer, seed: int, std: float) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in lora_parameters(m).items():
        p.add_(torch.randn(p.shape, generator=g) * (std if "lora_B" in name else 0.05))  # in place: versions move


def _generate(llm: LLM, **params) -> tuple[list[list[int]], torch.Tensor]:
    sp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, **(dict(temperature=0.0) | params))
    outs = llm.generate(PROMPTS, sp)
    ids = [o.outputs[0].token_ids for o in outs]
    lps = torch.tensor([v for o in outs for d in o.outputs[0].logprobs for v in d.values()])
    return ids, lps


def _reference(m: Transformer, **params) -> tuple[list[list[int]], torch.Tensor]:
    """The unmerged path: the model's own forward through its LoRA layers (a copy, so the packed engine's model is
    left as it is)."""
    ref = LLM(copy.deepcopy(m), cpu_packed_weights=False, **ENGINE)
    assert ref.engine.runner.packed is None
    return _generate(ref, **params)


def _assert_same(got, want) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "targets,kw",
    [("all-linear", {}), ("q,v,down", dict(attention_bias=True, mlp_bias=True))],
    ids=["all-projections", "some-with-bias"],
)
def test_packed_merged_lora_matches_unmerged_before_and_after_in_place_update(targets, kw):
    _require_onednn()
    m = _lora_model(targets, **kw)
    assert cpu_forward.supports(m)
    llm = LLM(m, **ENGINE)
    assert llm.engine.runner.packed is not None  # LoRA layers no longer send the engine to the unpacked path
    before = _generate(llm)
    _assert_same(before, _reference(m))
    with adapters_disabled(m):  # the merge follows the adapters: off, the base's outputs
        base_ids, _ = _generate(llm)
        assert base_ids == _reference(m)[0]
    assert _generate(llm)[0] == before[0]  # on again: re-merged
    _perturb_adapters(m, seed=5, std=0.3)  # an optimizer step in place, no update_weights call
    after = _generate(llm)
    assert after[0] != before[0]
    _assert_same(after, _reference(m))
    assert llm.engine.runner.packed.refresh() == 0  # nothing changed since: no re-merge


def test_packed_merged_lora_follows_an_optimizer_step_and_update_weights():
    """The RL loop's order: a training step on the adapters, then ``update_weights`` with the shared model."""
    _require_onednn()
    m = _lora_model()
    llm = LLM(m, **ENGINE)
    _generate(llm)
    opt = torch.optim.AdamW(lora_parameters(m).values(), lr=0.05)
    logits = m(torch.tensor([PROMPTS[1]]))
    logits.logsumexp(-1).mean().backward()
    opt.step()
    llm.update_weights(m)
    _assert_same(_generate(llm), _reference(m))
    sampled = dict(temperature=1.0, seed=7)
    _assert_same(_generate(llm, **sampled), _reference(m, **sampled))  # sampled with a seed: the same draws


def test_packed_merged_lora_keeps_the_base_weights_and_memory_of_one_copy():
    _require_onednn()
    m = _lora_model()
    base = {n: p.detach().clone() for n, p in m.named_parameters() if "lora_" not in n}
    packed = LLM(m, **ENGINE).engine.runner.packed
    for n, p in m.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n  # merged into the packed copy only, never into W
    projection_bytes = sum(
        p.numel() * 4 for n, p in m.named_parameters() if n.startswith("layers.") and "proj.weight" in n
    )
    packed_bytes = sum(g.weight.numel() * 4 for layer in packed.layers for g in layer)
    assert packed_bytes == projection_bytes  # one merged copy: no second copy for the adapters
