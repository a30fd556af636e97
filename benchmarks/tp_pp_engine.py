"""Tensor and pipeline parallelism together against one device on this CPU (gloo): greedy equality and throughput.

    python benchmarks/tp_pp_engine.py [--layouts 1x1 2x1 1x2 2x2] [--hidden 256]

The ``small`` preset (3M parameters, 6 layers, 8 heads on 4 KV heads; ``--hidden 768``: 43M), 32 greedy requests of
16-64 prompt tokens and 16-64 new tokens; per layout ``TxP`` (tensor_parallel_size x pipeline_parallel_size) the
seconds, tokens generated per second, whether the tokens equal one device's, and the CPU seconds each process spent
(driver first). One device runs the oneDNN-packed weights, the TP layouts the model's forward (packing is off
under TP).
"""

from __future__ import annotations

import argparse
import os
import random
import time

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer


def cpu_s(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks of 10 ms


def main(layouts: list[str], hidden: int) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(16, 64))] for _ in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 64), ignore_eos=True) for _ in prompts]
    reference = None
    print(f"load: {os.getloadavg()}")
    for layout in layouts:
        tp, pp = (int(x) for x in layout.split("x"))
        config = preset_config("small", 100, hidden_size=hidden, intermediate_size=hidden * 11 // 4)
        model = Transformer(config).init_weights(seed=0, std=0.05)
        llm = LLM(model, kv_cache_memory_mb=64, max_num_seqs=32, tensor_parallel_size=tp, pipeline_parallel_size=pp)
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
        row = f"| TP {tp} × PP {pp} | {seconds:.2f} | {tokens / seconds:.0f} | {out == reference} | {cpu} |"
        print(row, flush=True)
        llm.close()
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2", "2x2"], help="TxP, one device first")
    parser.add_argument("--hidden", type=int, default=256, help="width of the model (small preset: 256)")
    args = parser.parse_args()
    main(args.layouts, args.hidden)
