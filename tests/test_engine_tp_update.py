"""``update_weights`` on the tensor-parallel engine (2 gloo ranks on CPU): the driver checks the full weights, cuts
each rank's slices and sends each worker only its own.

A TP engine freshly built from ``other`` is the reference: updated to another model (its tokens then that model's on
one device) and back to ``other`` (a state dict), its driver's shard is bit-equal to the fresh one's and greedy
tokens and logprobs equal the fresh engine's exactly (so every rank's slices are), for the base and a LoRA adapter
served over it, and one device's holding ``other`` (tokens exact, logprobs 1e-5); the worker was sent its slices only
(its shard's bytes, not the model's). A state dict with a wrong-shape or an unknown tensor is one line and changes no
rank: the engine serves its old weights; a partial one updates what it names, as on one device. One TP engine (one
process group per process), so the fresh engine and the updated one are the same.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_adapter, tiny_engine_model

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.transformer import Transformer

CONFIG = dict(num_kv_blocks=40, block_size=4, max_num_seqs=8)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3, 4] * 6]


def _run(llm: LLM, lora: str | None = None) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True, lora=lora)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return [o.token_ids for o in outs], [[lp[t] for t, lp in zip(o.token_ids, o.logprobs)] for o in outs]


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row, ref in zip(a, b) for x, y in zip(row, ref))


@pytest.mark.slow
@pytest.mark.distributed
def test_update_weights_equals_a_fresh_engine_and_one_device_and_bad_tensors_change_nothing(tmp_path):
    first = tiny_engine_model(128)
    other = Transformer(first.config).init_weights(seed=7, std=0.1)
    random_adapter(other, tmp_path / "a", 1, "all-linear", 4)
    ones = {"first": LLM(first, **CONFIG), "other": LLM(other, **CONFIG)}  # one device, the references
    ones["other"].add_lora("a", tmp_path / "a")
    ref = {"base": _run(ones["other"]), "a": _run(ones["other"], "a")}

    tp = LLM(Transformer(other.config).init_weights(seed=7, std=0.1), tensor_parallel_size=2, **CONFIG)
    try:
        tp.add_lora("a", tmp_path / "a")
        fresh = {"base": _run(tp), "a": _run(tp, "a")}  # a TP engine freshly built from `other`
        fresh_shard = {k: v.clone() for k, v in tp.model.state_dict().items()}
        assert tp.engine.block_manager.gpu._by_hash  # the prompts' blocks are cached

        tp.update_weights(first)  # away (a Transformer) ...
        assert not tp.engine.block_manager.gpu._by_hash  # dropped, as one device drops them
        assert _run(tp)[0] == _run(ones["first"])[0] != fresh["base"][0]  # every rank changed: the checks can fail
        tp.update_weights(other.state_dict())  # ... and back (a state dict): the slicing start-up did
        shard = tp.model.state_dict()
        assert shard.keys() == fresh_shard.keys() and all(torch.equal(shard[k], fresh_shard[k]) for k in shard)
        for name, lora in (("base", None), ("a", "a")):  # the adapter keeps working over the new base
            got = _run(tp, lora)
            assert got == fresh[name]  # tokens and logprobs bit-equal to the fresh engine's: every rank's slices
            assert got[0] == ref[name][0] and _gap(got[1], ref[name][1]) < 1e-5

        # the worker was sent its slices only: its message is its shard's bytes (plus pickling), not the model's
        (sent,) = tp.engine.executor.update_bytes
        worker = tp.engine.executor.memory[1]
        held = worker["sharded_weights"] + worker["replicated_weights"]
        assert held <= sent < held + 512 * len(shard)  # the whole model would be twice that

        # a bad tensor after good ones: one line, nothing loaded on any rank (the prompts' blocks are cached now:
        # logprobs within float noise of a first run's)
        state = {k: v + 1.0 for k, v in first.state_dict().items()}
        for bad, error, match in (
            ({**state, "layers.1.mlp.up_proj.weight": torch.zeros(64, 16)}, RuntimeError, "size mismatch for"),
            ({**state, "layers.2.mlp.up_proj.weight": torch.zeros(64, 32)}, KeyError, "unexpected tensor"),
        ):
            with pytest.raises(error, match=match) as e:
                tp.update_weights(bad)
            assert "\n" not in str(e.value)
            got = _run(tp)
            assert got[0] == fresh["base"][0] and _gap(got[1], fresh["base"][1]) < 1e-5
        partial = {  # a partial update, as one device takes it: the rest stays
            "norm.weight": torch.full((32,), 2.0),
            "layers.0.mlp.down_proj.weight": first.state_dict()["layers.0.mlp.down_proj.weight"],
        }
        for llm in (tp, ones["other"]):
            llm.update_weights(partial)
        got, expected = _run(tp), _run(ones["other"])
        assert got[0] == expected[0] != fresh["base"][0] and _gap(got[1], expected[1]) < 1e-5
    finally:
        tp.close()
        for llm in ones.values():
            llm.close()
