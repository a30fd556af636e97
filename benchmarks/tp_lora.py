"""LoRA adapters on the tensor-parallel engine against one device on this CPU (gloo): equality and throughput.

    python benchmarks/tp_lora.py [--sizes 1 2]

The ``small`` preset (3M parameters), 32 greedy requests of 16-64 prompt tokens and 16-64 new tokens, a third on the
base, a third on adapter 'a' (r = 8, every projection), a third on 'b' (r = 8, q and v), all in the same steps; each
size also without adapters (every request on the base), to show what the adapters cost. The TP ranks and the one
device both run the model's own forward (no oneDNN-packed weights).
"""

from __future__ import annotations

import argparse
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


def base_model() -> Transformer:
    return Transformer(preset_config("small", 100)).init_weights(seed=0, std=0.05)


def write_adapter(path: Path, targets: str, seed: int) -> None:
    """A random r = 8 adapter (B drawn, so it changes the output) saved as a PEFT directory."""
    model = base_model()
    apply_lora(model, LoRAConfig(rank=8, alpha=16.0, targets=targets, base_model_name_or_path="small"), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    save_adapter(model, path)


def main(sizes: list[int]) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(16, 64))] for _ in range(32)]
    lengths = [rng.randint(16, 64) for _ in prompts]
    names = [(None, "a", "b")[i % 3] for i in range(len(prompts))]
    with tempfile.TemporaryDirectory() as root:
        write_adapter(Path(root) / "a", "all-linear", 1)
        write_adapter(Path(root) / "b", "q,v", 2)
        reference: dict[bool, list] = {}
        print("| engine | requests | seconds | tokens/s | equal to 1 device |\n|---|---|---:|---:|---|")
        for tp in sizes:
            config = dict(kv_cache_memory_mb=64, max_num_seqs=32, cpu_packed_weights=False)
            llm = LLM(base_model(), tensor_parallel_size=tp, **config)
            llm.add_lora("a", Path(root) / "a")
            llm.add_lora("b", Path(root) / "b")
            llm.generate(prompts[:3], [SamplingParams(temperature=0.0, max_tokens=4, lora=n) for n in names[:3]])
            for mixed in (True, False):
                params = [
                    SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, lora=n if mixed else None)
                    for k, n in zip(lengths, names)
                ]
                start = time.perf_counter()
                out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                seconds = time.perf_counter() - start
                reference.setdefault(mixed, out)
                what = "base / a / b mixed" if mixed else "all on the base"
                rate = sum(map(len, out)) / seconds
                print(f"| TP {tp} | {what} | {seconds:.2f} | {rate:.0f} | {out == reference[mixed]} |", flush=True)
            llm.close()
        changed = sum(x != y for x, y in zip(reference[True], reference[False]))
        print(f"adapters changed {changed} of the {sum(n is not None for n in names)} adapter requests' outputs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    main(parser.parse_args().sizes)
