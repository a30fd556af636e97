"""LoRA adapters and ``update_weights`` on the pipeline-parallel engine (2 stages on 2 gloo ranks on CPU, one layer
each), against one device's engine (whose multi-LoRA is itself checked against merged models in
test_engine_multi_lora):

* a batch mixing two adapters and the base gives one device's tokens and logprobs, with an adapter added while an
  iteration is in flight (it reaches the stage before the first iteration that uses it); a bad adapter directory is
  one line and the engine goes on serving;
* ``update_weights`` with another model's weights, then the same prompts (their prefix-cached blocks dropped): one
  device's tokens and logprobs with those weights, the adapters still applied; an unknown tensor name is one
  device's one-line error.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import random_adapter, server_model

import spinwheel
from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.lora import LoRAError

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PROMPTS = ["12+34=", "hello there", "7*8=", "The quick brown fox"]
CONFIG = dict(num_kv_blocks=128, block_size=4, max_num_seqs=16)
NAMES = (None, "a", "b")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A PP-2 engine and a one-device engine over the server tests' model (2 layers), and two adapters: 'a' on every
    projection (rank 4), 'b' on q and v (rank 2)."""
    root = tmp_path_factory.mktemp("adapters")
    base = server_model()
    random_adapter(base, root / "a", 1, "all-linear", 4)
    random_adapter(base, root / "b", 2, "q,v", 2)
    tok = spinwheel.Tokenizer.char_level()
    pp = LLM(copy.deepcopy(base), tok, pipeline_parallel_size=2, **CONFIG)
    one = LLM(copy.deepcopy(base), tok, **CONFIG)
    yield pp, one, root, tok
    pp.close()
    one.close()


def _params(name: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, logprobs=1, lora=name)


def _run(llm: LLM, prompts, params):
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [o.token_ids for o in outs], [[lp[t] for t, lp in zip(o.token_ids, o.logprobs)] for o in outs]


def _assert_equal(got, ref) -> None:
    assert got[0] == ref[0]
    assert max(abs(x - y) for row, r in zip(got[1], ref[1]) for x, y in zip(row, r)) < 1e-5


def test_mixed_adapters_equal_one_device_added_in_flight_and_a_bad_adapter_is_one_line(engines, tmp_path):
    pp, one, root, _ = engines
    for llm in (pp, one):
        llm.add_lora("a", root / "a")
    engine = pp.engine
    assert {len(p.factors) for p in engine.loras.projections()} == {1}  # the driver: its layer's 7 projections only
    assert len(engine.loras.projections()) == 7
    # every prompt under the base, 'a' and 'b'; added in turns so that each micro-batch gets rows of all three
    order = [n for k in range(len(PROMPTS)) for n in (NAMES if k % 2 == 0 else ("a", None, "b"))]
    prompts = [p for p in PROMPTS for _ in NAMES]
    for i, (prompt, name) in enumerate(zip(prompts, order)):  # the base's and 'a''s requests start
        if name != "b":
            engine.add_request(f"r{i}", prompt, _params(name))
    groups: list[int] = []
    row_groups = engine.loras.row_groups
    engine.loras.row_groups = lambda slots, device: groups.append(len(set(slots))) or row_groups(slots, device)
    engine.step()
    assert engine.executor.in_flight == 1  # an iteration on the stage while 'b' is added: it ships with the next
    pp.add_lora("b", root / "b")
    assert [s.name for s in engine.loras.pending] == ["b"]
    for i, (prompt, name) in enumerate(zip(prompts, order)):
        if name == "b":
            engine.add_request(f"r{i}", prompt, _params(name))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    del engine.loras.row_groups
    assert max(groups) == 3 and not engine.loras.pending  # steps held rows of the base and of both adapters
    one.add_lora("b", root / "b")
    got = [outs[f"r{i}"] for i in range(len(prompts))]
    got = [o.token_ids for o in got], [[lp[t] for t, lp in zip(o.token_ids, o.logprobs)] for o in got]
    _assert_equal(got, _run(one, prompts, [_params(n) for n in order]))
    for name in ("a", "b"):  # each adapter changes the output: the comparison can fail
        assert [t for t, n in zip(got[0], order) if n == name] != [t for t, n in zip(got[0], order) if n is None]

    other = spinwheel.load_model("tiny", vocab_size=100)  # another base: hidden size 128, not 32
    random_adapter(other, tmp_path / "other", 3, "q,v", 2, base_name="tiny")
    for path, match in (
        (tmp_path / "missing", "no adapter_config.json"),
        (tmp_path / "other", "the adapter's base has hidden_size 128, the model 32"),
        (root / "a", "serves an adapter named 'a' already"),
    ):
        with pytest.raises(LoRAError, match=match) as e:
            pp.add_lora("bad" if path != root / "a" else "a", path)
        assert "\n" not in str(e.value)
    assert engine.loras.names == ["a", "b"] and not engine.loras.pending
    _assert_equal(_run(pp, PROMPTS[1:2], _params("b")), _run(one, PROMPTS[1:2], _params("b")))


def test_update_weights_equals_one_device_with_those_weights(engines):
    pp, one, root, tok = engines
    engine, new = pp.engine, spinwheel.load_model("test", vocab_size=100, seed=9)
    before = _run(pp, PROMPTS, [_params(None)] * len(PROMPTS))  # the prompts' blocks are now prefix-cached
    bad = {"layers.7.mlp.up_proj.weight": new.layers[0].mlp.up_proj.weight}
    with pytest.raises(KeyError, match="update_weights: unexpected tensor 'layers.7.mlp.up_proj.weight'") as e:
        pp.update_weights(bad)
    with pytest.raises(KeyError) as e_one:
        one.update_weights(bad)
    assert str(e.value) == str(e_one.value)
    with pytest.raises(
        RuntimeError, match=r"size mismatch for 'norm.weight': \(3,\) given, the model's is \(32,\)"
    ) as e:
        pp.update_weights({"norm.weight": torch.zeros(3)})
    assert "\n" not in str(e.value)
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    for i, prompt in enumerate(PROMPTS[:2]):  # one per micro-batch
        engine.add_request(f"u{i}", prompt, first)
    outs = [o.outputs[0] for o in engine.step() if o.finished]
    assert engine.executor.in_flight == 1  # launched on the old weights: it finishes on them on every stage
    pp.update_weights(new)
    while engine.has_unfinished_requests():
        outs += [o.outputs[0] for o in engine.step() if o.finished]
    old = [o.token_ids for o in outs], [[o.logprobs[0][o.token_ids[0]]] for o in outs]
    _assert_equal(old, ([t[:1] for t in before[0][:2]], [lp[:1] for lp in before[1][:2]]))

    ref = LLM(copy.deepcopy(new), tok, **CONFIG)
    for name in ("a", "b"):
        ref.add_lora(name, root / name)
    params = [_params(n) for _ in PROMPTS for n in NAMES]
    prompts = [p for p in PROMPTS for _ in NAMES]
    got = _run(pp, prompts, params)  # the same prompts: their old blocks must not be reused
    _assert_equal(got, _run(ref, prompts, params))
    assert got[0][::3] != before[0]  # the new weights change the output: the comparison can fail
    ref.close()
