"""Adapter-only weight sync (``rl/llm/rollouts/weight_sync.py``): with LoRA, an engine that holds its own copy of the
policy
receives the adapters alone after an update and then generates, token for token, what an engine given every weight
of the merged model generates; the bytes sent are the adapters'; an RL run with the rollout producer
(``--max-staleness``) logs them per update."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import server_model, small_config

import spinwheel
from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.lora import LoRAConfig, apply_lora, lora_parameters, merge
from spinwheel.rl.llm import loop
from spinwheel.rl.llm.rollouts.weight_sync import state_bytes, sync_state

PROMPTS = ["12+34=", "hello there", "7*8=", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def engine(model) -> LLM:
    return LLM(model, spinwheel.Tokenizer.char_level(), num_kv_blocks=128, block_size=4)


def adapter_bytes(model) -> int:
    """r (in + out) fp32 factors per adapted projection: the formula, from the layer shapes."""
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    return sum(m.rank * (m.in_features + m.out_features) * 4 for m in layers)


def test_adapter_only_sync_equals_a_full_merged_weight_sync():
    policy = server_model()
    apply_lora(policy, LoRAConfig(rank=4, alpha=8.0), seed=1)
    copy_engine = engine(copy.deepcopy(policy).requires_grad_(False))  # the producer's copy, taken at the start
    before = tokens(copy_engine)
    # An "update": every factor moves (B away from zero), as AdamW moves them; the base stays frozen.
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in lora_parameters(policy).values():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    state = sync_state(policy)
    assert set(state) == set(lora_parameters(policy)) and len(state) == 2 * 7 * len(policy.layers)
    assert state_bytes(state) == adapter_bytes(policy) == sum(p.numel() * 4 for p in lora_parameters(policy).values())
    full = {k: v for k, v in merge(copy.deepcopy(policy)).state_dict().items() if not k.startswith("rotary.")}
    assert state_bytes(state) < state_bytes(full) / 5
    copy_engine.update_weights(state)  # adapter-only: loaded into the copy's own LoRA layers, unmerged
    reference = engine(server_model())  # a plain copy of the base, given every weight of the merged model
    reference.update_weights(full)
    after = tokens(copy_engine)
    assert after == tokens(reference)
    assert after != before  # the update changes what is generated: the comparison can fail


def test_without_lora_every_weight_is_sent():
    model = server_model()
    state = sync_state(model)
    assert set(state) == {k for k in model.state_dict() if not k.startswith("rotary.")}
    assert state_bytes(state) == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.usefixtures("digit_reward")
@pytest.mark.slow
def test_lora_producers_receive_the_adapters_alone_and_give_the_synchronous_run(tmp_path, monkeypatch):
    """``--max-staleness 0`` with the producer's engine copy in this process (thread) or in a child (``--rollout-
    engine process``, which builds the same LoRA layers): each update sends the adapters alone, and the run is the
    synchronous LoRA run exactly (an engine copy serving the bare base, or stale adapters, samples other tokens)."""
    jobs: list[loop.RLJob] = []
    init = loop.RLJob.__init__
    monkeypatch.setattr(loop.RLJob, "__init__", lambda self, *a, **k: init(self, *a, **k) or jobs.append(self))
    lora = dict(steps=2, lora_rank=4, lora_alpha=8)
    runs = {
        name: [r for r in loop.train_rl(small_config(tmp_path / name, **lora, **kw))["history"] if "reward_mean" in r]
        for name, kw in (
            ("sync", {}),
            ("thread", dict(max_staleness=0)),
            ("process", dict(max_staleness=0, rollout_engine="process")),
        )
    }
    for key in ("reward_mean", "loss", "kl_ref", "grad_norm", "mismatch_max"):
        assert [r[key] for r in runs["thread"]] == [r[key] for r in runs["process"]] == [r[key] for r in runs["sync"]]
    adapters = lora_parameters(jobs[0].learner.model)
    expected = sum(p.numel() * p.element_size() for p in adapters.values())
    assert "sync_bytes" not in runs["sync"][-1]  # the synchronous loop's engine serves the trainer's own model
    for name in ("thread", "process"):
        assert [r["sync_bytes"] for r in runs[name]] == [expected, expected], name
        assert runs[name][-1]["weight_swaps"] == 1, name  # step 1 needed version 1
    assert runs["thread"][-1]["sync_load_s"] > 0
    assert runs["process"][-1]["weight_publish_mb"] == pytest.approx(expected / 2**20)
    # The thread producer's engine copy holds the frozen base bitwise and the trained adapters of version 1.
    thread_job = jobs[1]
    copy_state = thread_job.rollouts.llm.engine.model.state_dict()
    for name, p in thread_job.learner.model.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(copy_state[name], p), name
    assert all(copy_state[n].abs().max() > 0 for n in adapters if "lora_B" in n)
