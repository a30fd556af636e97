"""The tensor-parallel engine (``LLM(..., tensor_parallel_size=2)``) on 2 gloo ranks on CPU against one device.

One TP-2 engine (the driver here, one spawned worker) serves every test of the module; the last one kills its worker.

* greedy output equals one device's token for token on a mixed workload (random prompts and lengths, shared
  prefixes) with chunked prefill, prefix caching and recompute preemption (a KV pool too small for the batch),
  and with swap preemption (blocks moved to and from the CPU pool on every rank; a second engine, last);
* seeded sampling, with parallel samples (forks: copy-on-write block copies sent to the worker), equals one device's;
* each rank holds half of the sharded weights and half of every KV block (the same number of blocks);
* a TP degree that does not divide the heads or KV heads: one-line error, no process started;
* a killed worker: the next step raises :class:`TensorParallelError` (no hang) and the LLM closes.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
from helpers import tiny_engine_model

from spinwheel.engine import LLM, SamplingParams
from spinwheel.engine.parallel.tp_executor import TensorParallelError

# small pool (20 blocks of 4 = 80 tokens for up to 8 sequences) and token budget: preemption and chunked prefill
CONFIG = dict(num_kv_blocks=20, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def engines():
    tp = LLM(tiny_engine_model(128), tensor_parallel_size=2, **CONFIG)
    one = LLM(tiny_engine_model(128), **CONFIG)
    yield tp, one
    tp.close()
    one.close()


def _workload(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 100) for _ in range(9)]
    prompts = []
    for i in range(10):
        tail = [rng.randrange(3, 100) for _ in range(rng.randint(1, 30))]
        prompts.append(shared + tail if i % 3 == 0 else tail)  # a third share a 2-block prefix
    return prompts, [rng.randint(1, 24) for _ in prompts]


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]


@pytest.mark.slow
@pytest.mark.distributed
def test_greedy_equals_one_device_with_chunks_prefix_cache_and_preemption(engines):
    tp, one = engines
    prompts, lengths = _workload(0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    executor = tp.engine.executor
    calls, forwards = dict(executor.comm.stats.calls), executor.forwards
    assert _tokens(tp, prompts, params) == _tokens(one, prompts, params)
    # per forward: one all-reduce after each attention and each MLP, one for the vocab-parallel embedding; the
    # logits gathered once
    steps, layers = executor.forwards - forwards, tp.model.config.num_hidden_layers
    assert executor.comm.stats.calls["all_reduce"] - calls.get("all_reduce", 0) == steps * (2 * layers + 1)
    assert executor.comm.stats.calls["all_gather"] - calls.get("all_gather", 0) == steps
    sched = tp.engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_preemptions == one.engine.scheduler.num_preemptions
    assert tp.engine.block_manager.num_prefix_hit_tokens > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_seeded_sampling_with_forks_equals_one_device(engines):
    tp, one = engines
    prompts, lengths = _workload(1)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, n=2, seed=100 + i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(lengths[:5])
    ]
    assert _tokens(tp, prompts[:5], params) == _tokens(one, prompts[:5], params)


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_holds_half_the_weights_and_of_every_block(engines):
    tp, one = engines
    memory = tp.engine.executor.memory
    full = sum(p.numel() * p.element_size() for p in one.model.parameters())
    assert len(memory) == 2 and memory[0] == memory[1]
    replicated = memory[0]["replicated_weights"]  # the norms
    assert memory[0]["sharded_weights"] * 2 + replicated == full
    assert memory[0]["kv_cache"] * 2 == one.engine.runner.kv_cache_bytes
    assert tp.engine.runner.num_blocks == one.engine.runner.num_blocks


def test_tp_degree_must_divide_heads_before_anything_starts():
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 must divide the model's num_key_value_heads \(2\)"):
        LLM(tiny_engine_model(128), tensor_parallel_size=4, **CONFIG)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(tiny_engine_model(128), tensor_parallel_size=3, **CONFIG)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM("test", tensor_parallel_size=3)  # from the preset's config, before any weight exists
    assert len(multiprocessing.active_children()) == before


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_worker_raises_and_closes(engines):
    tp, _ = engines
    (worker,) = tp.engine.executor.procs
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker 1 .* exited with code -9"):
        tp.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))
    tp.close()
    assert time.monotonic() - start < 10
    assert not tp.engine.executor.procs


@pytest.mark.slow
@pytest.mark.distributed
def test_swap_preemption_equals_one_device(engines):
    engines[0].close()  # one tensor-parallel group per process: the module's engine is done (closing is idempotent)
    config = {**CONFIG, "preemption_mode": "swap", "num_cpu_blocks": 20}
    tp = LLM(tiny_engine_model(128), tensor_parallel_size=2, **config)
    one = LLM(tiny_engine_model(128), **config)
    try:
        prompts, lengths = _workload(2)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        assert _tokens(tp, prompts, params) == _tokens(one, prompts, params)
        assert tp.engine.scheduler.num_preemptions > 0
    finally:
        tp.close()
        one.close()


def test_tp_option_of_serve_and_generate():
    from spinwheel.cli import _engine_from_args, build_parser

    parser = build_parser()
    for command in (["serve", "--model", "test"], ["generate", "--model", "test", "--prompt", "x"]):
        assert _engine_from_args(parser.parse_args([*command, "--tp", "2"])).tensor_parallel_size == 2
        assert _engine_from_args(parser.parse_args(command)).tensor_parallel_size == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_tp4_equals_one_device_and_hf_generate(tmp_path):
    """TP 4 (a model with 8 heads on 4 KV heads: 2 and 1 per rank) on the mixed workload with preemption: greedy
    and seeded (n = 2) output equal one device's, and the greedy output HF ``generate``'s."""
    import torch
    import transformers

    from spinwheel.models.config import ModelConfig
    from spinwheel.models.hf import save_pretrained
    from spinwheel.models.transformer import Transformer

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8)
    model = Transformer(ModelConfig(vocab_size=128, num_key_value_heads=4, **shape)).eval()
    prompts, lengths = _workload(1)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    seeded = [
        SamplingParams(temperature=1.0, max_tokens=n, seed=7 + i, n=2, ignore_eos=True) for i, n in enumerate(lengths)
    ]
    outputs = []
    for extra in ({}, {"tensor_parallel_size": 4}):
        llm = LLM(model, **CONFIG, **extra)
        try:
            outputs.append((_tokens(llm, prompts, greedy), _tokens(llm, prompts, seeded)))
            assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.close()
    assert outputs[1] == outputs[0]
    save_pretrained(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    for prompt, n, (ours,) in zip(prompts, lengths, outputs[0][0]):
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert ids[0, len(prompt) :].tolist() == ours
