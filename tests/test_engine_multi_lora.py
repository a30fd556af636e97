"""Multi-LoRA serving in the engine (S-LoRA / Punica): requests of different adapters, and of none, in one batch give
token for token what each adapter served alone gives, and what its merged model gives; the prefix cache never shares
K/V across adapters; bad adapters fail in one line."""

import copy

import pytest
from helpers import all_blocks_free, random_adapter, server_model

import spinwheel
from spinwheel.engine import LLM, SamplingParams
from spinwheel.engine.kv.block_manager import BlockManager
from spinwheel.models.lora import LoRAConfig, LoRAError, apply_lora

PROMPTS = ["12+34=", "hello there", "7*8=", "The quick brown fox"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters on the server tests' model: 'a' on every projection (rank 4), 'b' on q and v (rank 2)."""
    root = tmp_path_factory.mktemp("adapters")
    base = server_model()
    merged = {
        "a": random_adapter(base, root / "a", 1, "all-linear", 4),
        "b": random_adapter(base, root / "b", 2, "q,v", 2),
    }
    return base, {"a": root / "a", "b": root / "b"}, merged


def llm(model, **config):
    return LLM(copy.deepcopy(model), spinwheel.Tokenizer.char_level(), num_kv_blocks=128, block_size=4, **config)


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("packed", [True, False], ids=["cpu-packed", "model-forward"])
def test_a_mixed_batch_equals_each_adapter_alone_and_its_merged_model(adapters, packed):
    base, dirs, merged = adapters
    engine = llm(base, cpu_packed_weights=packed)
    assert (engine.engine.runner.packed is not None) == packed
    for name, path in dirs.items():
        engine.add_lora(name, path)
    greedy = {name: SamplingParams(temperature=0, max_tokens=8, lora=name) for name in (None, "a", "b")}
    groups: list[int] = []
    registry = engine.engine.loras
    row_groups = registry.row_groups
    registry.row_groups = lambda slots, device: groups.append(len(set(slots))) or row_groups(slots, device)
    # every prompt under the base, 'a' and 'b', all added before the first step: they share every step
    order = [name for _ in PROMPTS for name in greedy]
    mixed = texts(engine.generate([p for p in PROMPTS for _ in greedy], [greedy[n] for n in order]))
    assert max(groups) == 3  # steps held rows of the base and both adapters
    for name in greedy:
        got = [t for t, n in zip(mixed, order) if n == name]
        alone = texts(engine.generate(PROMPTS, greedy[name]))  # one adapter over every row: no gather
        reference = llm(base if name is None else merged[name])  # the plain (or merged) model, no adapters
        assert got == alone == texts(reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8)))
        if name is not None:  # the adapter changes what is generated: the comparison can fail
            assert got != [t for t, n in zip(mixed, order) if n is None]
    assert all_blocks_free(engine.engine)


def test_the_prefix_cache_never_shares_kv_across_adapters(adapters):
    base, dirs, merged = adapters
    engine = llm(base)
    engine.add_lora("a", dirs["a"])
    bm = engine.engine.block_manager
    prompt = "The quick brown fox jumps over"  # 30 tokens: 7 full blocks of 4 reusable
    params = {name: SamplingParams(temperature=0, max_tokens=6, lora=name) for name in (None, "a")}
    first = texts(engine.generate(prompt, params[None]))
    hits = bm.num_prefix_hit_tokens
    assert texts(engine.generate(prompt, params["a"])) == texts(llm(merged["a"]).generate(prompt, params[None]))
    assert bm.num_prefix_hit_tokens == hits  # the base's blocks were not read for the adapter
    assert texts(engine.generate(prompt, params["a"])) == texts(llm(merged["a"]).generate(prompt, params[None]))
    assert bm.num_prefix_hit_tokens > hits  # the adapter's own blocks are
    hits = bm.num_prefix_hit_tokens
    assert texts(engine.generate(prompt, params[None])) == first and bm.num_prefix_hit_tokens > hits

    # the accounts alone: the same tokens in two namespaces are two chains; a fork keeps its parent's
    manager = BlockManager(16, 0, 4)
    tokens = list(range(13))
    for seq_id, namespace in ((0, None), (1, "a"), (2, "a"), (3, None)):
        hit = manager.allocate(seq_id, tokens, namespace=namespace)
        assert hit == (12 if seq_id >= 2 else 0)
        manager.commit(seq_id, tokens, 13)
    manager.fork(1, 4)
    manager.free(1)
    manager.append_slots(4, 12, 14)
    manager.commit(4, tokens + [13], 14)
    assert manager.allocate(5, tokens, namespace="a") == 12
    manager.check_invariants()


def test_bad_adapters_fail_in_one_line(adapters, tmp_path):
    base, dirs, _ = adapters
    engine = llm(base)
    other = spinwheel.load_model("tiny", vocab_size=100)  # another base: hidden size 128, not 32
    random_adapter(other, tmp_path / "other", 3, "q,v", 2, base_name="tiny")
    with pytest.raises(LoRAError, match="the adapter's base has hidden_size 128, the model 32") as e:
        engine.add_lora("other", tmp_path / "other")
    assert "\n" not in str(e.value) and engine.engine.loras.names == []
    engine.add_lora("a", dirs["a"])
    with pytest.raises(LoRAError, match="serves an adapter named 'a' already"):
        engine.add_lora("a", dirs["b"])
    with pytest.raises(ValueError, match="unknown LoRA adapter 'b' \\(the engine serves: a\\)"):
        engine.generate("hi", SamplingParams(lora="b"))
    with pytest.raises(ValueError, match="lora must be an adapter's name"):
        SamplingParams(lora="")
    trained = copy.deepcopy(base)
    apply_lora(trained, LoRAConfig(rank=2))
    with pytest.raises(LoRAError, match="carries trained LoRA layers"):
        llm(trained).add_lora("a", dirs["a"])
