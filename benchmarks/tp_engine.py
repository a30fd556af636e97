"""Tensor-parallel engine against one device on this CPU (gloo): greedy equality, per-rank memory, throughput.

    python benchmarks/tp_engine.py [--sizes 1 2 4] [--mem]

Throughput: the ``small`` preset (3M parameters, 8 heads on 4 KV heads), 32 greedy requests of 16-64 prompt tokens
and 16-64 new tokens; one device with and without the oneDNN-packed weights (the TP ranks run the model's own
forward). ``--mem``: a 160M-parameter model (1024 wide, 8 layers, 16 heads on 8 KV heads, vocab 32000, fp32) with a
256 MiB KV pool; each rank's resident memory after one request (RssAnon: the process's own, not the shared libraries).
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.config import ModelConfig
from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer


def rss_mib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon:"))


def throughput(sizes: list[int]) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(16, 64))] for _ in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 64), ignore_eos=True) for _ in prompts]
    runs = [("1 device, packed", 1, True), ("1 device, model forward", 1, False)]
    runs += [(f"TP {n}", n, False) for n in sizes if n > 1]
    reference = None
    for name, tp, packed in runs:
        model = Transformer(preset_config("small", 100)).init_weights(seed=0, std=0.05)
        llm = LLM(model, kv_cache_memory_mb=64, max_num_seqs=32, tensor_parallel_size=tp, cpu_packed_weights=packed)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm
        start = time.perf_counter()
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        seconds = time.perf_counter() - start
        reference = reference or out
        tokens = sum(map(len, out))
        print(f"| {name} | {seconds:.2f} | {tokens / seconds:.0f} | {out == reference} |", flush=True)
        llm.close()


def memory(sizes: list[int]) -> None:
    cfg = ModelConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    )
    for tp in sizes:
        base = rss_mib()
        model = Transformer(cfg).init_weights(seed=0)
        llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_mb=256, cpu_packed_weights=False)
        del model
        gc.collect()
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))
        ranks = [rss_mib()] + [rss_mib(p.pid) for p in (llm.engine.executor.procs if tp > 1 else [])]
        accounted = llm.engine.executor.memory[0] if tp > 1 else None
        print(f"TP {tp}: RssAnon per rank {ranks} MiB (driver's before the model: {base}); {accounted}", flush=True)
        llm.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mem", action="store_true", help="the per-rank memory run instead of throughput")
    args = parser.parse_args()
    memory(args.sizes) if args.mem else throughput(args.sizes)
