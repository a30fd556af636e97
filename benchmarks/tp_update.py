"""``update_weights`` on the tensor-parallel engine against one device on this CPU: seconds per update, the bytes
each worker is sent, and greedy equality with one device after the update.

    python benchmarks/tp_update.py [--sizes 1 2] [--repeats 5] [--big]

The ``small`` preset (8 heads on 4 KV heads, vocab 100), or with ``--big`` a 160M-parameter model (1024 wide,
8 layers, 16 heads on 8 KV heads, vocab 32000, fp32). Each engine starts from one set of weights and is updated
``repeats`` times, alternating between two other models (a state dict each time, on the CPU); one device's update
is measured with its oneDNN-packed weights (the default: an update repacks them) and without; the TP ranks run the
model's own forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.config import ModelConfig
from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer


def config(big: bool) -> ModelConfig:
    if not big:
        return preset_config("small", 100)
    return ModelConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=1024,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big", action="store_true")
    args = ap.parse_args()
    cfg = config(args.big)
    states = [Transformer(cfg).init_weights(seed=s, std=0.05).state_dict() for s in (1, 2)]
    model_mib = sum(t.numel() * t.element_size() for t in states[0].values()) / 2**20
    prompts = [[5 + i, 6, 7, 8, 9 + i] * 4 for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = None
    runs = [(n, packed) for n in args.sizes for packed in ((True, False) if n == 1 else (False,))]
    for tp, packed in runs:
        model = Transformer(cfg).init_weights(seed=0, std=0.05)
        llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_mb=32, cpu_packed_weights=packed)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm
        seconds = []
        for i in range(args.repeats):
            start = time.perf_counter()
            llm.update_weights(states[(i + 1) % 2])  # the last one is states[args.repeats % 2]
            seconds.append(time.perf_counter() - start)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        reference = reference or tokens
        sent = getattr(llm.engine.executor, "update_bytes", [])
        print(
            f"tp {tp}{' (oneDNN-packed)' if packed else ''}: model {model_mib:.2f} MiB; update_weights median "
            f"{statistics.median(seconds) * 1e3:.1f} ms "
            f"(min {min(seconds) * 1e3:.1f}, max {max(seconds) * 1e3:.1f}); per worker sent "
            f"{[round(b / 2**20, 2) for b in sent]} MiB; greedy equal to the first size's: {tokens == reference}",
            flush=True,
        )
        llm.close()


if __name__ == "__main__":
    main()
