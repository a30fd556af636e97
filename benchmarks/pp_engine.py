"""Pipeline-parallel engine against one device on this CPU (gloo): greedy equality, per-stage memory, throughput.

    python benchmarks/pp_engine.py [--sizes 1 2 3] [--mem]

Throughput: the ``small`` preset (3M parameters, 6 layers; ``--hidden 768``: 43M, the MLP 2.75x as wide), 32 greedy
requests of 16-64 prompt tokens and 16-64 new tokens, the oneDNN-packed weights everywhere (every stage runs them on
its layers); per layout the seconds, tokens/s, equality with one device, the most iterations in flight at once, and
the CPU seconds each process spent (driver first); the control runs PP with every request in one micro-batch (one
iteration in flight: no overlap).
``--mem``: a 160M-parameter model (1024 wide, 8 layers, vocab 32000, fp32) with a 256 MiB KV pool; each stage's
accounted weights and KV cache, and its resident memory after one request (RssAnon: the process's own).
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


def cpu_s(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks of 10 ms


def throughput(sizes: list[int], hidden: int) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(16, 64))] for _ in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 64), ignore_eos=True) for _ in prompts]
    reference = None
    runs = [(pp, pp) for pp in sizes] + [(pp, 1) for pp in sizes if pp > 1]
    for pp, micro in runs:
        config = preset_config("small", 100, hidden_size=hidden, intermediate_size=hidden * 11 // 4)
        model = Transformer(config).init_weights(seed=0, std=0.05)
        llm = LLM(model, kv_cache_memory_mb=64, max_num_seqs=32, pipeline_parallel_size=pp)
        if micro < pp:  # the control: every request in one micro-batch, so one iteration in flight at a time
            llm.engine.micro = llm.engine.micro[:micro]
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm
        executor = llm.engine.executor
        pids = ["self"] + [p.pid for p in (executor.procs if executor else [])]
        cpu = [cpu_s(p) for p in pids]
        start = time.perf_counter()
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        seconds = time.perf_counter() - start
        cpu = [round(cpu_s(p) - c, 1) for p, c in zip(pids, cpu)]
        reference = reference or out
        tokens = sum(map(len, out))
        flight = executor.most_in_flight if executor else 1
        name = "1 device" if pp == 1 else f"PP {pp}" + ("" if micro == pp else ", one micro-batch")
        print(
            f"| {name} | {seconds:.2f} | {tokens / seconds:.0f} | {out == reference} | {flight} | {cpu} |", flush=True
        )
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
    for pp in sizes:
        base = rss_mib()
        model = Transformer(cfg).init_weights(seed=0)
        llm = LLM(model, pipeline_parallel_size=pp, kv_cache_memory_mb=256, cpu_packed_weights=False)
        del model
        gc.collect()
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))
        executor = llm.engine.executor
        stages = [rss_mib()] + [rss_mib(p.pid) for p in (executor.procs if executor else [])]
        mib = [{k: round(v / 2**20, 1) for k, v in m.items()} for m in executor.memory] if executor else None
        print(f"PP {pp}: RssAnon per stage {stages} MiB (driver's before the model: {base}); MiB {mib}", flush=True)
        llm.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--mem", action="store_true", help="the per-stage memory run instead of throughput")
    parser.add_argument("--hidden", type=int, default=256, help="width of the throughput model (small preset: 256)")
    args = parser.parse_args()
    memory(args.sizes) if args.mem else throughput(args.sizes, args.hidden)
