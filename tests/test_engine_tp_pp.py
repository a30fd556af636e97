"""Tensor and pipeline parallelism together (``LLM(..., tensor_parallel_size=2, pipeline_parallel_size=2)``): 2
stages of 2 TP ranks, 4 gloo ranks on CPU, against one device's engine.

One TP-2 × PP-2 engine over the server tests' model (2 layers: one per stage, each split in two) serves every test
of the module; the last one kills a rank.

* greedy tokens and logprobs equal one device's on a mixed workload (long prompts, shared prefixes) with chunked
  prefill, prefix caching and swap preemption, both micro-batches in flight; each rank holds a quarter of the
  layers' sharded weights and of every KV block;
* seeded sampling with parallel samples (copy-on-write block copies on every rank) equals one device's;
* a LoRA adapter mixed with the base in a batch, then ``update_weights`` with another model's weights: one device's
  tokens and logprobs (each rank serves its stage's layers' factors, sliced for its TP rank);
* degrees the model cannot be split by: one-line error, no process started;
* a killed rank: the next step raises :class:`TensorParallelError` naming its stage and TP rank (a collective of
  the driver's own forward fails, or the step is refused), no hang.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import os
import random
import signal
import time

import pytest
from helpers import random_adapter, server_model, tiny_engine_model

import spinwheel
from spinwheel.engine import LLM, SamplingParams
from spinwheel.engine.parallel.tp_executor import TensorParallelError
from spinwheel.rl.llm.rollouts.engine_tp import EngineTPExecutor

pytestmark = [pytest.mark.distributed]

# 40 blocks of 4 (20 per micro-batch: a micro-batch swaps a request out), a 16-token budget: long prompts are
# prefilled in chunks
CONFIG = dict(
    num_kv_blocks=40,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    max_model_len=80,
    preemption_mode="swap",
    num_cpu_blocks=8,
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = server_model()  # the `test` preset: 4 heads on 2 KV heads, MLP 64, vocabulary 100
    random_adapter(base, root / "a", 1, "all-linear", 4)
    tok = spinwheel.Tokenizer.char_level()
    both = LLM(copy.deepcopy(base), tok, tensor_parallel_size=2, pipeline_parallel_size=2, **CONFIG)
    one = LLM(copy.deepcopy(base), tok, **CONFIG)
    yield both, one, root, tok
    both.close()
    one.close()


def _workload(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 100) for _ in range(9)]
    prompts = []
    for i in range(8):
        tail = [rng.randrange(3, 100) for _ in range(rng.randint(1, 30))]
        prompts.append(shared + tail if i % 3 == 0 else tail)  # a third share a 2-block prefix
    return prompts, [rng.randint(1, 16) for _ in prompts]


def _run(llm: LLM, prompts, params) -> tuple[list, list]:
    outs = [c for out in llm.generate(prompts, params) for c in out.outputs]
    return [c.token_ids for c in outs], [[lp[t] for t, lp in zip(c.token_ids, c.logprobs)] for c in outs]


def _assert_equal(got, ref) -> None:
    assert got[0] == ref[0]
    assert max(abs(x - y) for row, r in zip(got[1], ref[1]) for x, y in zip(row, r)) < 1e-5


@pytest.mark.slow  # the module's engine (4 processes)
def test_greedy_tokens_and_logprobs_equal_one_device_with_chunks_and_prefix_cache(engines):
    both, one, _, _ = engines
    prompts, lengths = _workload(0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=True) for n in lengths]
    _assert_equal(_run(both, prompts, params), _run(one, prompts, params))
    micro, executor = both.engine.micro, both.engine.executor
    assert all(m.scheduler.num_chunked_prefills > 0 for m in micro)
    assert sum(m.block_manager.num_prefix_hit_tokens for m in micro) > 0
    assert sum(m.scheduler.num_swap_outs for m in micro) > 0  # blocks moved to the CPU pool and back on every rank
    assert executor.most_in_flight == 2  # both micro-batches in the pipeline at once
    # per rank: its stage's layer (a quarter of the model's layers' weights, plus its stage's norms whole), and a
    # quarter of every KV block, as many blocks as one device
    norms = sum(p.numel() for n, p in one.model.named_parameters() if n.startswith("layers.") and "norm" in n)
    layers = sum(p.numel() for n, p in one.model.named_parameters() if n.startswith("layers."))
    assert [m["layer_weights"] for m in executor.memory] == [((layers - norms) // 4 + norms // 2) * 4] * 4
    assert [m["kv_cache"] * 4 for m in executor.memory] == [one.engine.runner.kv_cache_bytes] * 4
    assert both.engine.runner.num_blocks == one.engine.runner.num_blocks


@pytest.mark.slow  # the module's engine (4 processes)
def test_seeded_sampling_with_forks_equals_one_device(engines):
    both, one, _, _ = engines
    prompts, lengths = _workload(1)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, n=2, seed=100 + i, max_tokens=n, logprobs=1, ignore_eos=True)
        for i, n in enumerate(lengths[:5])
    ]
    got = _run(both, prompts[:5], params)
    assert [len(t) for t in got[0]] == [n for n in lengths[:5] for _ in range(2)]  # every request fits a micro-batch
    _assert_equal(got, _run(one, prompts[:5], params))


@pytest.mark.slow  # the module's engine (4 processes)
def test_lora_and_update_weights_equal_one_device(engines):
    both, one, root, tok = engines
    both.add_lora("a", root / "a")
    one.add_lora("a", root / "a")
    prompts = ["12+34=", "hello there", "7*8=", "The quick brown fox"]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=1, lora=n) for n in ("a", None, "a", None)]
    got = _run(both, prompts, params)
    _assert_equal(got, _run(one, prompts, params))
    assert got[0][0::2] != _run(one, prompts[0::2], params[1:2] * 2)[0]  # the adapter changes the output
    new = spinwheel.load_model("test", vocab_size=100, seed=9)
    both.update_weights(new)
    ref = LLM(copy.deepcopy(new), tok, **CONFIG)
    ref.add_lora("a", root / "a")
    after = _run(both, prompts, params)  # the same prompts: their prefix-cached blocks must not be reused
    _assert_equal(after, _run(ref, prompts, params))
    assert after[0] != got[0]  # the new weights change the output
    ref.close()


def test_degrees_the_model_cannot_be_split_by_fail_before_anything_starts():
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the model's num_attention_heads \(4\)"):
        LLM(tiny_engine_model(128), tensor_parallel_size=3, pipeline_parallel_size=2, num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 must divide the model's num_hidden_layers \(2\)"):
        LLM(tiny_engine_model(128), tensor_parallel_size=2, pipeline_parallel_size=3, num_kv_blocks=8)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        LLM("test", tensor_parallel_size=3, pipeline_parallel_size=2)  # the preset's config, before any weight
    shard = tiny_engine_model(128)
    rl_engine = functools.partial(EngineTPExecutor, None)  # the RL loop's --engine-tp: torchrun's ranks, no stages
    with pytest.raises(ValueError, match="--engine-tp runs the RL engine in torchrun's ranks, without stages"):
        LLM(shard, executor=rl_engine, tensor_parallel_size=2, pipeline_parallel_size=2, num_kv_blocks=8)
    assert len(multiprocessing.active_children()) == before


@pytest.mark.slow  # the module's engine (4 processes)
def test_killed_rank_raises_naming_it(engines):
    both = engines[0]
    procs = both.engine.executor.procs
    assert len(procs) == 3
    os.kill(procs[0].pid, signal.SIGKILL)  # rank 1: stage 0's TP rank 1, whose all-reduces the driver's forward needs
    start = time.monotonic()  # not joined: the step may start before its exit shows, and fail in a collective
    with pytest.raises(TensorParallelError, match=r"worker 1 \(pipeline stage 0, tensor-parallel rank 1; .*-9"):
        both.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))
    both.close()
    assert time.monotonic() - start < 10
    assert not both.engine.executor.procs
