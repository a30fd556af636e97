"""The CUDA paths: model parity with HF in fp32 and bf16, paged attention against dense attention, the engine against
HF ``generate`` (with swap preemption through pinned CPU blocks), and the parallel trainer on NCCL.

Skipped where no CUDA device exists (the CI machines); ``scripts/device_check.sh`` runs them on a lent GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import TINY_LLAMA_EOS, TINY_LLAMA_VOCAB

from spinwheel.engine import LLM, SamplingParams
from spinwheel.engine.kernels.attention import DecodeBucket, PagedAttentionMetadata, PrefillSpan, paged_attention
from spinwheel.models import load_model
from spinwheel.models.transformer import SDPAAttention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _hf(path, dtype=torch.float32):
    """A fresh HF model from the `tiny_llama` checkpoint (conftest.py) on the GPU (the fixture's CPU copy is never
    moved or cast)."""
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, TINY_LLAMA_VOCAB, (n,), generator=g).tolist() for n in (1, 4, 9, 16, 23, 31, 40, 64)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_model_logits_match_hf_on_cuda(tiny_llama, dtype, tol):
    path, _ = tiny_llama
    ours = load_model(path, dtype=dtype, device="cuda")
    ids = torch.randint(3, TINY_LLAMA_VOCAB, (3, 40), device="cuda")
    with torch.no_grad():
        want = _hf(path, dtype)(ids).logits.float()
        got = ours(ids).float()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= tol * max(scale, 1.0)


def test_paged_attention_matches_dense_on_cuda():
    torch.manual_seed(0)
    dev = "cuda"
    h, g, d, bs, num_blocks = 4, 2, 16, 4, 40
    k_cache = torch.zeros(num_blocks, bs, g, d, device=dev)
    v_cache = torch.zeros(num_blocks, bs, g, d, device=dev)
    perm = torch.randperm(num_blocks).tolist()
    specs = [(9, 8, 1), (6, 5, 1), (13, 0, 13), (23, 10, 13)]  # (total, cached, new): decodes first
    seqs = []
    for total, cached, new in specs:
        table = [perm.pop() for _ in range(-(-total // bs))]
        q, k, v = (torch.randn(total, n, d, device=dev) for n in (h, g, g))
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)], device=dev)
        k_cache.view(-1, g, d)[slots[:cached]] = k[:cached]
        v_cache.view(-1, g, d)[slots[:cached]] = v[:cached]
        seqs.append((total, cached, new, table, q, k, v, slots))
    decodes, prefills = seqs[:2], seqs[2:]
    max_blocks = max(len(s[3]) for s in decodes)
    tables = torch.tensor([s[3] + [0] * (max_blocks - len(s[3])) for s in decodes], device=dev)
    lens = torch.tensor([s[0] for s in decodes], device=dev)
    bias = torch.zeros(len(decodes), max_blocks * bs, device=dev).masked_fill(
        torch.arange(max_blocks * bs, device=dev)[None] >= lens[:, None], float("-inf")
    )[:, None, None]
    spans, row = [], len(decodes)
    for total, cached, new, table, *_ in prefills:
        spans.append(PrefillSpan(row, new, total, torch.tensor(table, device=dev)))
        row += new
    meta = PagedAttentionMetadata(torch.cat([s[7][s[1] :] for s in seqs]), [DecodeBucket(0, tables, bias, lens)], spans)
    out = paged_attention(
        torch.cat([s[4][s[1] :] for s in seqs]),
        torch.cat([s[5][s[1] :] for s in seqs]),
        torch.cat([s[6][s[1] :] for s in seqs]),
        k_cache,
        v_cache,
        meta,
    )
    row = 0
    for total, cached, new, _, q, k, v, _ in seqs:
        dense = SDPAAttention()(q[None], k[None], v[None], None, 0)[0]
        torch.testing.assert_close(out[row : row + new], dense[cached:], atol=1e-5, rtol=1e-5)
        row += new


def _hf_greedy(hf, prompt, max_new=16):
    out = hf.generate(
        torch.tensor([prompt], device=hf.device),
        max_new_tokens=max_new,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device),
        eos_token_id=TINY_LLAMA_EOS,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "config",
    [dict(), dict(block_size=4, num_kv_blocks=24, preemption_mode="swap", num_cpu_blocks=24)],
    ids=["default", "swap"],
)
def test_engine_greedy_matches_hf_on_cuda(tiny_llama, config):
    path, _ = tiny_llama
    prompts = _prompts()
    hf = _hf(path)
    with torch.no_grad():
        want = [_hf_greedy(hf, p) for p in prompts]
    llm = LLM(str(path), device="cuda", dtype="float32", **config)
    assert llm.engine.runner.packed is None and not llm.engine.runner.fused_decode  # CPU-only paths are off
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_engine_bf16_prompt_logprobs_match_hf_on_cuda(tiny_llama):
    path, _ = tiny_llama
    prompt = _prompts()[-1]
    llm = LLM(str(path), device="cuda", dtype="bfloat16")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    with torch.no_grad():
        lp = F.log_softmax(_hf(path, torch.bfloat16)(torch.tensor([prompt], device="cuda")).logits.float()[0], dim=-1)
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]]
        assert abs(got - lp[pos - 1, prompt[pos]].item()) < 0.1, pos


def _nccl_layouts(rank: int, world_size: int) -> dict[str, float]:
    """Each layout trains the same model as one plain CUDA process; returns the worst relative loss error."""
    from spinwheel.models.presets import preset_config
    from spinwheel.models.transformer import Transformer
    from spinwheel.parallel import ParallelConfig, ParallelTrainer

    def model():
        return Transformer(preset_config("test", 64, num_hidden_layers=2)).init_weights(seed=1).cuda()

    gen = torch.Generator().manual_seed(2)
    batches = [
        (
            torch.randint(0, 64, (4, 12), generator=gen).cuda(),
            torch.randint(0, 64, (4, 12), generator=gen).cuda(),
            torch.ones(4, 12, device="cuda"),
        )
        for _ in range(4)
    ]
    ref_model = model()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    ref = []
    for ids, labels, mask in batches:
        loss = F.cross_entropy(ref_model(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    errors = {}
    for name, kw in (("ddp", {}), ("zero2", dict(zero=2)), ("fsdp", dict(fsdp=True))):
        trainer = ParallelTrainer(model(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ParallelConfig(**kw))
        losses = [trainer.step(*b) for b in batches]
        errors[name] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    return errors


@pytest.mark.slow
@pytest.mark.distributed
def test_parallel_trainer_on_nccl_matches_single_process():
    from spinwheel.parallel import spawn

    results = spawn(_nccl_layouts, 1, timeout_s=240, backend="nccl")
    assert all(err < 1e-5 for err in results[0].values()), results[0]
