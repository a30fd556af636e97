"""Checkpoint configs that would exhaust memory (issue 12 item 12): ``config.json`` is checked against the
safetensors headers before anything is allocated, in a line and well within a second; a context longer than the KV
pool can hold is capped to the pool, with a message."""

import json
import logging
import time

import pytest
import torch

import spinwheel
from spinwheel.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from spinwheel.models import CheckpointError, ModelConfig, Transformer, save_pretrained

CFG = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture
def checkpoint(tmp_path):
    save_pretrained(Transformer(ModelConfig(**CFG)).init_weights(seed=0, std=0.1), tmp_path)
    return tmp_path


def _doctor(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000, but the checkpoint's tensors hold 2 layers"),
        ({"num_hidden_layers": 3}, "num_hidden_layers is 3, but the checkpoint's tensors hold 2 layers"),
        ({"num_hidden_layers": 1}, "unexpected tensor 'model.layers.1."),
        ({"intermediate_size": 10**9}, "gate_proj.weight' has shape (64, 32), expected (1000000000, 32)"),
        ({"vocab_size": 10**9}, "'model.embed_tokens.weight' has shape (100, 32), expected (1000000000, 32)"),
        ({"hidden_size": 2**20, "head_dim": 8}, "embed_tokens.weight' has shape (100, 32), expected (100, 1048576)"),
        ({"num_key_value_heads": 4}, "'model.layers.0.self_attn.k_proj.weight' has shape (16, 32), expected (32, 32)"),
    ],
)  # fmt: skip
def test_a_config_that_disagrees_with_the_tensors_fails_in_a_line_before_allocating(checkpoint, changes, needle):
    # torch imports its meta-device kernels on a process's first meta op (1-2 s, once): not the check's own time
    with torch.device("meta"):
        Transformer(ModelConfig(**CFG))
    _doctor(checkpoint, **changes)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        spinwheel.load_model(checkpoint)
    assert time.monotonic() - t0 < 1.0
    assert needle in str(e.value) and "\n" not in str(e.value)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="num_hidden_layers|shape|unexpected"):
        LLMEngine.from_pretrained(checkpoint, EngineConfig(device="cpu"))
    assert time.monotonic() - t0 < 1.0


def test_the_check_reads_only_headers(checkpoint, monkeypatch):
    # a doctored config fails before any tensor is read: loading tensors would raise here
    from spinwheel.models import hf

    def no_tensors(path):
        raise AssertionError("tensors read before the config was checked")

    monkeypatch.setattr(hf, "load_state_dict", no_tensors)
    _doctor(checkpoint, num_hidden_layers=10**6)
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        spinwheel.load_model(checkpoint)


def test_a_context_longer_than_the_kv_pool_is_capped_with_a_message(checkpoint, tmp_path_factory, caplog):
    reference = LLM(str(checkpoint), block_size=8, num_kv_blocks=32)
    assert reference.engine.max_model_len == 256  # max_position_embeddings, which the pool holds
    doctored = tmp_path_factory.mktemp("doctored")
    for f in checkpoint.iterdir():
        (doctored / f.name).write_bytes(f.read_bytes())
    _doctor(doctored, max_position_embeddings=10**12)
    with caplog.at_level(logging.WARNING, logger="spinwheel.engine.llm_engine"):
        llm = LLM(str(doctored), block_size=8, num_kv_blocks=16)
    assert llm.engine.max_model_len == 16 * 8
    assert "max_model_len capped to 128 tokens" in caplog.text and "1000000000000" in caplog.text
    # the weights are the same: generation equals the undoctored checkpoint's; too long a request is refused
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = list(range(5, 25))
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == (
        reference.generate([prompt], params)[0].outputs[0].token_ids
    )
    long = llm.generate([prompt], SamplingParams(max_tokens=120))[0]
    assert long.error is not None and "exceeds the model context of 128 tokens" in long.error
    # the pool is what kv_cache_memory_mb allows, however long the config claims the context to be
    small = LLMEngine.from_pretrained(doctored, EngineConfig(block_size=8, kv_cache_memory_mb=0.25, device="cpu"))
    assert small.runner.kv_cache_bytes <= 0.25 * 2**20
    assert small.max_model_len == small.runner.num_blocks * 8 < 10**12
    # an explicit max_model_len is the caller's: not capped
    explicit = LLMEngine.from_pretrained(doctored, EngineConfig(block_size=8, num_kv_blocks=16, max_model_len=512))
    assert explicit.max_model_len == 512
    assert torch.equal(llm.model.embed_tokens.weight, reference.model.embed_tokens.weight)
