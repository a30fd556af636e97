"""The pipeline-parallel engine (``LLM(..., pipeline_parallel_size=2)``): 2 stages on 2 gloo ranks on CPU, against
one device and Hugging Face ``generate``.

One PP-2 engine over the tiny HF Llama checkpoint (the driver here with layer 0, one spawned stage with layer 1)
serves every test of the module; the last one kills its stage.

* greedy output equals one device's and HF ``generate``'s token for token on a mixed workload (random prompts and
  lengths, shared prefixes) with chunked prefill, prefix caching, and swap and recompute preemption (a KV pool too
  small for the batch, a CPU pool too small for every preempted group), with two iterations in flight;
* seeded sampling with parallel samples (copy-on-write block copies sent to the stage) and beam search equal one
  device's;
* an abort of a request whose iteration is in flight ends it once the iteration is back, its blocks freed;
* each stage holds half the layers' weights and half of every KV block (the same number of blocks), plus its edge;
* a PP degree that does not divide the layers: one-line error, no process started (with TP: test_engine_tp_pp);
* a killed stage: the next step raises :class:`PipelineParallelError` (no hang) and the LLM closes.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
import torch
from helpers import TINY_LLAMA_EOS, TINY_LLAMA_VOCAB, tiny_engine_model

from spinwheel.engine import LLM, SamplingParams
from spinwheel.engine.parallel.pp_executor import PipelineParallelError

pytestmark = [pytest.mark.distributed]

# small pool (40 blocks of 4, 20 per micro-batch) and token budget: preemption (swap, and recompute once the
# 20-block CPU pool is full) and chunked prefill
CONFIG = dict(
    num_kv_blocks=40,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    preemption_mode="swap",
    num_cpu_blocks=20,
    max_model_len=80,
)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    path, _ = tiny_llama
    pp = LLM(str(path), pipeline_parallel_size=2, **CONFIG)
    one = LLM(str(path), **CONFIG)
    yield pp, one
    pp.close()
    one.close()


def _workload(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, TINY_LLAMA_VOCAB) for _ in range(9)]
    prompts = []
    for i in range(10):
        tail = [rng.randrange(3, TINY_LLAMA_VOCAB) for _ in range(rng.randint(1, 30))]
        prompts.append(shared + tail if i % 3 == 0 else tail)  # a third share a 2-block prefix
    return prompts, [rng.randint(1, 24) for _ in prompts]


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]


def _hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=TINY_LLAMA_EOS,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow  # the module's engine (2 processes)
def test_greedy_equals_one_device_and_hf_with_chunks_prefix_cache_and_preemption(engines, tiny_llama):
    pp, one = engines
    prompts, lengths = _workload(0)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths]
    got = _tokens(pp, prompts, params)
    assert got == _tokens(one, prompts, params)
    assert [g[0] for g in got] == [_hf_greedy(tiny_llama[1], p, n) for p, n in zip(prompts, lengths)]
    micro = pp.engine.micro
    assert all(m.scheduler.num_chunked_prefills > 0 for m in micro)
    assert sum(m.scheduler.num_swap_outs for m in micro) > 0  # swapped, and recomputed once the CPU pool was full
    assert sum(m.scheduler.num_preemptions for m in micro) > sum(m.scheduler.num_swap_outs for m in micro)
    assert sum(m.block_manager.num_prefix_hit_tokens for m in micro) > 0
    assert pp.engine.executor.most_in_flight == 2  # both micro-batches in the pipeline at once
    stats = pp.stats()  # summed over the micro-batches
    assert (stats.num_blocks, stats.num_free_blocks, stats.num_running) == (40, 40, 0)
    assert stats.num_preemptions == sum(m.scheduler.num_preemptions for m in micro) and stats.prefix_cache_hit_rate > 0


@pytest.mark.slow  # the module's engine (2 processes)
def test_seeded_sampling_with_forks_and_beams_equal_one_device(engines):
    pp, one = engines
    prompts, lengths = _workload(1)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, n=2, seed=100 + i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(lengths[:5])
    ]
    assert _tokens(pp, prompts[:5], params) == _tokens(one, prompts[:5], params)
    beams = [[c.token_ids for c in o.outputs] for o in pp.beam_search(prompts[:3], beam_width=3, max_tokens=6)]
    assert beams == [[c.token_ids for c in o.outputs] for o in one.beam_search(prompts[:3], beam_width=3, max_tokens=6)]


@pytest.mark.slow  # the module's engine (2 processes)
def test_abort_of_a_request_in_flight_waits_for_its_iteration(engines):
    engine = engines[0].engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9, 10], params)  # the other micro-batch
    engine.step()  # both launched, "a"'s iteration processed: "b"'s is in flight
    busy = [m for m in engine.micro if m.busy]
    assert len(busy) == 1 and busy[0].holds("b")
    used = busy[0].block_manager.num_used_blocks
    assert used > 0 and engine.abort("b")
    assert busy[0].block_manager.num_used_blocks == used  # not freed under the stage computing on them
    finished = {}
    while engine.has_unfinished_requests():
        if "a" not in finished:
            engine.abort("a")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["b"].outputs[0].finish_reason == "abort" and len(finished["b"].outputs[0].token_ids) <= 2
    assert all(m.block_manager.num_used_blocks == 0 for m in engine.micro)


@pytest.mark.slow  # the module's engine (2 processes)
def test_warm_up_leaves_every_micro_batch_as_it_was(engines):
    from spinwheel.engine.kernels.warmup import warm_up

    engine = engines[0].engine
    counters = lambda: [(m.scheduler.num_preemptions, m.block_manager.num_prefix_queried_tokens) for m in engine.micro]  # noqa: E731
    before = counters()
    warm_up(engine)
    assert counters() == before
    assert all(not m.block_manager.gpu._by_hash for m in engine.micro)  # both prefix caches dropped


@pytest.mark.slow  # the module's engine (2 processes)
def test_each_stage_holds_half_the_layers_and_of_every_block(engines):
    pp, one = engines
    memory = pp.engine.executor.memory
    model = one.model
    layers = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers."))
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    assert len(memory) == 2 and memory[0]["layer_weights"] == memory[1]["layer_weights"] == layers // 2
    assert memory[0]["edge_weights"] == embed.numel() * embed.element_size()  # the embedding
    norm = model.norm.weight
    assert memory[1]["edge_weights"] == head.numel() * head.element_size() + norm.numel() * norm.element_size()
    assert (
        memory[0]["kv_cache"] == memory[1]["kv_cache"] and memory[0]["kv_cache"] * 2 == one.engine.runner.kv_cache_bytes
    )
    assert pp.engine.runner.num_blocks == one.engine.runner.num_blocks


def test_pp_degree_must_divide_layers_before_anything_starts():
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 must divide the model's num_hidden_layers \(2\)"):
        LLM(tiny_engine_model(128), pipeline_parallel_size=3, num_kv_blocks=8)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        LLM("test", pipeline_parallel_size=4)  # from the preset's config, before any weight exists
    assert len(multiprocessing.active_children()) == before


@pytest.mark.slow  # the module's engine (2 processes)
def test_killed_stage_raises_and_closes(engines):
    pp, _ = engines
    (stage,) = pp.engine.executor.procs
    os.kill(stage.pid, signal.SIGKILL)
    stage.join(10)
    start = time.monotonic()
    with pytest.raises(PipelineParallelError, match="stage 1 .* exited with code -9"):
        pp.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))
    pp.close()
    assert time.monotonic() - start < 10
    assert not pp.engine.executor.procs


def test_pp_option_of_serve_and_generate():
    from spinwheel.cli import _engine_from_args, build_parser

    parser = build_parser()
    for command in (["serve", "--model", "test"], ["generate", "--model", "test", "--prompt", "x"]):
        assert _engine_from_args(parser.parse_args([*command, "--pp", "2"])).pipeline_parallel_size == 2
        assert _engine_from_args(parser.parse_args(command)).pipeline_parallel_size == 1
