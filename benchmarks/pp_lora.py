"""LoRA adapters and ``update_weights`` on the pipeline-parallel engine against one device (this CPU, gloo).

    python benchmarks/pp_lora.py [--sizes 1 2] [--hidden 256]

The ``small`` preset (6 layers; ``--hidden`` widens it, the MLP 2.75x as wide) and two random adapters: 'a' on every
projection, 'b' on q and v, both rank 8. Per layout: the milliseconds of ``add_lora`` (the driver reads and checks
the directory; the stages get their part with the next iteration), 32 greedy requests a third each through the base,
'a' and 'b' (seconds, tokens/s, equal to one device), the same requests on the base alone, then ``update_weights``
with another model's weights: the call's milliseconds, and those of the call plus a one-token request (by which
every stage has loaded its part), and the 32 requests again (equal to one device with those weights).
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time
from pathlib import Path

import torch

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.lora import LoRAConfig, apply_lora, lora_parameters
from spinwheel.models.lora_io import save_adapter
from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer


def adapter(base: Transformer, path: Path, seed: int, targets: str) -> None:
    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(rank=8, alpha=16.0, targets=targets, base_model_name_or_path="small"), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    save_adapter(model, path)


def tokens(llm: LLM, prompts, params) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return out, time.perf_counter() - start


def main(sizes: list[int], hidden: int) -> None:
    config = preset_config("small", 100, hidden_size=hidden, intermediate_size=hidden * 11 // 4)
    base, new = (Transformer(config).init_weights(seed=s, std=0.05) for s in (0, 1))
    root = Path(tempfile.mkdtemp())
    adapter(base, root / "a", 1, "all-linear")
    adapter(base, root / "b", 2, "q,v")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(16, 64))] for _ in range(32)]
    lengths = [rng.randint(16, 64) for _ in prompts]
    mixed = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, lora=(None, "a", "b")[i % 3]) for i, n in
             enumerate(lengths)]  # fmt: skip
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    reference: dict[str, list] = {}
    for pp in sizes:
        llm = LLM(copy.deepcopy(base), kv_cache_memory_mb=64, max_num_seqs=32, pipeline_parallel_size=pp)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm
        start = time.perf_counter()
        llm.add_lora("a", root / "a")
        llm.add_lora("b", root / "b")
        add_ms = (time.perf_counter() - start) * 500
        out, seconds = tokens(llm, prompts, mixed)
        base_out, base_seconds = tokens(llm, prompts, plain)
        start = time.perf_counter()
        llm.update_weights(new)
        call_ms = (time.perf_counter() - start) * 1000
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))
        applied_ms = (time.perf_counter() - start) * 1000
        after, _ = tokens(llm, prompts, mixed)
        reference = reference or {"mixed": out, "base": base_out, "after": after}
        n = sum(map(len, out))
        print(
            f"| {'1 device' if pp == 1 else f'PP {pp}'} | {add_ms:.1f} | {seconds:.2f} | {n / seconds:.0f} | "
            f"{out == reference['mixed']} | {n / base_seconds:.0f} | {base_out == reference['base']} | {call_ms:.1f} | "
            f"{applied_ms:.1f} | {after == reference['after']} |",
            flush=True,
        )
        llm.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    main(args.sizes, args.hidden)
