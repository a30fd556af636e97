"""The CPU swap pool is never larger than the device KV pool (Kwon et al. 2023, §4.5: the blocks swapped out never
outnumber the device's, so the swap space is bounded by the KV cache): ``swap_space_mb`` is capped at the pool, an
exact ``num_cpu_blocks`` above it is refused with one line naming the option, the pool's size and the way out."""

import importlib

import pytest
from helpers import tiny_engine_model

from spinwheel.cli import main
from spinwheel.engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(128)


def test_exact_pools_swap_pool_at_most_the_kv_pool():
    assert EngineConfig(num_kv_blocks=24, num_cpu_blocks=24).num_cpu_blocks == 24
    with pytest.raises(ValueError, match=r"num_cpu_blocks must be <= 24, the KV pool's size in blocks .*got 25"):
        EngineConfig(num_kv_blocks=24, num_cpu_blocks=25)


def test_pool_sized_by_memory_caps_swap_space_mb_and_refuses_a_larger_exact_swap_pool(model):
    config = EngineConfig(kv_cache_memory_mb=0.05, preemption_mode="swap", swap_space_mb=1.0, max_model_len=64)
    engine = LLMEngine(model, None, config)
    pool = engine.runner.num_blocks
    assert 1 < pool < 256 and engine.block_manager.cpu.num_blocks == pool  # swap_space_mb capped at the pool
    exact = EngineConfig(kv_cache_memory_mb=0.05, preemption_mode="swap", num_cpu_blocks=pool, max_model_len=64)
    assert LLMEngine(model, None, exact).block_manager.cpu.num_blocks == pool
    with pytest.raises(ValueError, match=rf"--engine-num-cpu-blocks\) must be <= {pool}, .* got {pool + 1}"):
        LLMEngine(model, None, EngineConfig(kv_cache_memory_mb=0.05, num_cpu_blocks=pool + 1, max_model_len=64))


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["serve", "--engine-num-kv-blocks", "24", "--engine-num-cpu-blocks", "64"],
            "--engine-num-cpu-blocks must be <= 24, the KV pool's size in blocks (--engine-num-kv-blocks), got 64: "
            "swap space is never larger than the pool it backs; lower it, or leave it unset to size the swap pool "
            "by --engine-swap-space-mb (capped at the pool)",
        ),
        (  # the pool is sized once the model is known: the runner's check, the same one line
            ["generate", "--prompt", "hi", "--engine-kv-cache-memory-mb", "1", "--engine-num-cpu-blocks", "43"],
            "num_cpu_blocks (--engine-num-cpu-blocks) must be <= 42, the KV pool's size in blocks (sized by "
            "kv_cache_memory_mb), got 43",
        ),
    ],
)
def test_command_line_gets_one_line_naming_the_option(argv, message, capsys, monkeypatch):
    serve_module = importlib.import_module("spinwheel.server.serve")  # the package re-exports its function
    monkeypatch.setattr(serve_module, "serve", lambda *a: pytest.fail("the server started"))
    assert main([*argv, "--model", "tiny", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(f"spinwheel {argv[0]}: error: {message}")
