"""LoRA adapters on the tensor-parallel engine (2 gloo ranks on CPU): a batch mixing two adapters and the base gives
one device's multi-LoRA engine's tokens (itself checked against the merged models in test_engine_multi_lora) and
logprobs; an adapter added between steps reaches the worker before the step that uses it; a bad adapter directory
is one line and the engine goes on serving."""

from __future__ import annotations

import copy

import pytest
from helpers import random_adapter, server_model

import spinwheel
from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.lora import LoRAError

PROMPTS = ["12+34=", "hello there", "7*8=", "The quick brown fox"]
CONFIG = dict(num_kv_blocks=128, block_size=4, max_num_seqs=16)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A TP-2 engine and a one-device engine over the server tests' model, and two adapters: 'a' on every projection
    (rank 4: the column and the row-parallel splits), 'b' on q and v (rank 2)."""
    root = tmp_path_factory.mktemp("adapters")
    base = server_model()
    random_adapter(base, root / "a", 1, "all-linear", 4)
    random_adapter(base, root / "b", 2, "q,v", 2)
    tok = spinwheel.Tokenizer.char_level()
    tp = LLM(copy.deepcopy(base), tok, tensor_parallel_size=2, **CONFIG)
    one = LLM(copy.deepcopy(base), tok, **CONFIG)
    yield tp, one, root
    tp.close()
    one.close()


def _run(llm: LLM, prompts, params):
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [o.token_ids for o in outs], [[lp[t] for t, lp in zip(o.token_ids, o.logprobs)] for o in outs]


@pytest.mark.slow
@pytest.mark.distributed
def test_mixed_adapters_equal_one_device_and_a_bad_adapter_is_one_line(engines, tmp_path):
    tp, one, root = engines
    for llm in (tp, one):
        llm.add_lora("a", root / "a")
    params = {n: SamplingParams(temperature=0, max_tokens=8, logprobs=1, lora=n) for n in (None, "a", "b")}
    # a first step with 'a' only; 'b' is added after it, so it reaches the worker with a later step
    assert _run(tp, PROMPTS[:1], params["a"])[0] == _run(one, PROMPTS[:1], params["a"])[0]
    for llm in (tp, one):
        llm.add_lora("b", root / "b")
    groups: list[int] = []
    registry = tp.engine.loras
    row_groups = registry.row_groups
    registry.row_groups = lambda slots, device: groups.append(len(set(slots))) or row_groups(slots, device)
    order = [n for _ in PROMPTS for n in params]  # every prompt under the base, 'a' and 'b': they share each step
    prompts, batch = [p for p in PROMPTS for _ in params], [params[n] for n in order]
    (tokens, logprobs), (ref_tokens, ref_logprobs) = _run(tp, prompts, batch), _run(one, prompts, batch)
    del registry.row_groups
    assert max(groups) == 3  # steps held rows of the base and of both adapters
    assert tokens == ref_tokens
    assert max(abs(x - y) for row, ref in zip(logprobs, ref_logprobs) for x, y in zip(row, ref)) < 1e-5
    for name in ("a", "b"):  # each adapter changes the output: the comparison can fail
        assert [t for t, n in zip(tokens, order) if n == name] != [t for t, n in zip(tokens, order) if n is None]

    other = spinwheel.load_model("tiny", vocab_size=100)  # another base: hidden size 128, not 32
    random_adapter(other, tmp_path / "other", 3, "q,v", 2, base_name="tiny")
    for path, match in (
        (tmp_path / "missing", "no adapter_config.json"),
        (tmp_path / "other", "the adapter's base has hidden_size 128, the model 32"),
    ):
        with pytest.raises(LoRAError, match=match) as e:
            tp.add_lora("bad", path)
        assert "\n" not in str(e.value)
    assert tp.engine.loras.names == ["a", "b"] and not tp.engine.loras.pending
    assert _run(tp, PROMPTS[1:2], params["a"])[0] == _run(one, PROMPTS[1:2], params["a"])[0]
