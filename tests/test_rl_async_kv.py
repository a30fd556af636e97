"""In-flight weight updates, checked token by token against a reference forward.

A sample spans two weight swaps (versions 0 → 1 → 2 published while it decodes). Each sampled token records the
version that sampled it; what the engine's log-prob of that token must equal depends on the K/V its prefix had:

* ``--kv-on-update recompute``: every running sequence is prefilled again under the new weights, so token i's
  log-prob is the trainer's under version v_i given the whole prefix under v_i (one plain forward per version);
* ``keep`` (stale KV, PipelineRL): a position's hidden states (its K/V at every layer and the logits read off it)
  are computed once, in the engine step that feeds it, by the weights current then — the version that sampled the
  *next* token; prompt positions by the version of the first sampled token (one prefill). Token i's log-prob is
  that of an incremental forward in which position j is computed by that version and attends to the K/V cached
  for the positions before it (:func:`mixed_kv_logprobs`). Tokens after a swap then differ from every plain
  forward — the statement is exact, not a tolerance hiding stale K/V.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.hf import load_model
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import apply_rope
from spinwheel.rl.llm.rollouts.async_rollouts import VersionedEngine, WeightBox

PROMPT = "12+34="
SWAPS = {3: 1, 6: 2}  # engine step -> the version published just before it


@pytest.fixture(scope="module")
def versions_and_tokenizer():
    tok = Tokenizer.char_level()
    models = [load_model("test", seed=0, vocab_size=tok.vocab_size)]
    for k in (1, 2):
        m = copy.deepcopy(models[-1])
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)) * 0.3)
        models.append(m)
    return models, tok


def generate_across_swaps(models, tok, kv: str):
    """(engine, the prompt's ids, {sample index: completion}) of a request whose samples span both swaps."""
    box = WeightBox(0)
    engine = VersionedEngine(LLM(copy.deepcopy(models[0]), tok).engine, box, 0, kv=kv)
    prompt = tok.encode(PROMPT)
    engine.add_request("r", prompt, SamplingParams(n=2, max_tokens=10, ignore_eos=True, seed=3, logprobs=0))
    outputs = {}
    for k in range(40):
        if k in SWAPS:
            box.publish(SWAPS[k], models[SWAPS[k]])
        for out in engine.step(stream=False):
            outputs.update({c.index: c for c in out.outputs if c.finish_reason is not None})
        if len(outputs) == 2:
            break
    assert engine.num_swaps == 2
    return engine, prompt, outputs


@torch.no_grad()
def mixed_kv_logprobs(models, ids: list[int], kv_versions: list[int]) -> torch.Tensor:
    """log p(ids[j + 1] | ids[: j + 1]) for every j < len(kv_versions), where position j's hidden states at every
    layer (its K/V and its logits) come from ``models[kv_versions[j]]``, attending to the K/V each earlier position
    cached under its own version: decoding one position at a time with a KV cache and per-position weights."""
    layers = len(models[0].layers)
    keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    out = []
    for j, v in enumerate(kv_versions):
        m = models[v]
        x = m.embed_tokens(torch.tensor([[ids[j]]]))  # (1, 1, C)
        cos, sin = m.rotary(torch.tensor([[j]]), x.dtype)
        for i, block in enumerate(m.layers):
            att, h = block.self_attn, block.input_layernorm(x)
            q, k, val = (proj(h).view(1, 1, -1, att.head_dim) for proj in (att.q_proj, att.k_proj, att.v_proj))
            if att.q_norm is not None:
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys[i].append(k)
            values[i].append(val)
            kk, vv = torch.cat(keys[i], 1).transpose(1, 2), torch.cat(values[i], 1).transpose(1, 2)  # (1, G, j+1, D)
            qq = q.transpose(1, 2)  # (1, H, 1, D)
            rep = qq.shape[1] // kk.shape[1]
            kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            a = F.scaled_dot_product_attention(qq, kk, vv).transpose(1, 2).reshape(1, 1, -1)
            x = x + att.o_proj(a)
            x = x + block.mlp(block.post_attention_layernorm(x))
        logp = torch.log_softmax(m.lm_head(m.norm(x))[0, 0].float(), -1)
        out.append(logp[ids[j + 1]])
    return torch.stack(out)


@torch.no_grad()
def plain_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[j + 1] | ids[: j + 1]) for j >= start - 1 under one model (the whole prefix under it)."""
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(x[:, :-1]).float(), -1)[0, start - 1 :]
    return logp.gather(-1, x[0, start:, None])[:, 0]


def _check(engine, prompt, outputs, models, kv: str):
    for index, c in outputs.items():
        versions = engine.token_versions("r", index, len(c.token_ids))
        assert versions == sorted(versions) and set(versions) == {0, 1, 2}  # both swaps fall mid-sample
        ids = prompt + list(c.token_ids)
        engine_lp = torch.tensor([lp[t] for t, lp in zip(c.token_ids, c.logprobs)])
        under_own = torch.stack(  # each token under its version's weights, given the whole prefix under them
            [plain_logprobs(models[v], ids, len(prompt))[i] for i, v in enumerate(versions)]
        )
        if kv == "recompute":
            torch.testing.assert_close(engine_lp, under_own, rtol=1e-4, atol=1e-4)
            continue
        kv_versions = [versions[0]] * len(prompt) + versions[1:]
        mixed = mixed_kv_logprobs(models, ids, kv_versions)[len(prompt) - 1 :]
        torch.testing.assert_close(engine_lp, mixed, rtol=1e-4, atol=1e-4)
        after = torch.tensor([i > 0 and versions[i - 1] != v for i, v in enumerate(versions)])
        assert (engine_lp - under_own)[after].abs().max() > 1e-3  # the stale K/V shows right after each swap


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_in_flight_tokens_match_the_weights_and_kv_that_sampled_them(versions_and_tokenizer, kv):
    models, tok = versions_and_tokenizer
    engine, prompt, outputs = generate_across_swaps(models, tok, kv)
    assert engine.num_recomputed == (2 if kv == "recompute" else 0)
    _check(engine, prompt, outputs, models, kv)


def test_no_request_added_after_a_swap_reads_old_kv(versions_and_tokenizer):
    """With stale KV kept, the blocks a running sequence goes on filling hold old K/V: a request with the same
    tokens added after the swap is served none of them from the prefix cache (it computes its prompt)."""
    models, tok = versions_and_tokenizer
    box = WeightBox(0)
    engine = VersionedEngine(LLM(copy.deepcopy(models[0]), tok, block_size=4).engine, box, 0)
    prompt = tok.encode("1234567890+12=")
    engine.add_request("a", prompt, SamplingParams(max_tokens=12, ignore_eos=True, seed=1))
    engine.step(stream=False)
    box.publish(1, models[1])
    for _ in range(4):
        engine.step(stream=False)
    before = engine.block_manager.num_prefix_hit_tokens
    engine.add_request("b", prompt, SamplingParams(max_tokens=1, seed=1))
    engine.step(stream=False)
    assert engine.block_manager.num_prefix_hit_tokens == before
