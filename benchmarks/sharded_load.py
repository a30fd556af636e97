"""Per-rank memory of the start-up load under a sharded layout (issue 26): the lazy load
(:mod:`spinwheel.parallel.io.lazy_load`) against the old path (the full checkpoint read on every rank, then cut and
sharded by ``parallelize``).

    python benchmarks/sharded_load.py [--hidden 1024] [--layers 8] [--vocab 32000] [--json out.json]

Writes a random HF checkpoint (fp32, two safetensors shards with an index; ~170M parameters by default) to a
temporary directory, then for ZeRO-3 and for tp 2 builds a frozen ``ParallelTrainer`` on 2 spawned ranks (gloo)
from it, once with ``load_model(path)`` (old) and once with ``load_model(path, lazy=True)``. Each (layout, path)
runs in fresh rank processes; a sampler thread reads ``/proc/self/status`` every millisecond and the figures are
the peak over the load minus the value just before it: ``VmRSS`` (what the brief asks for; it includes the pages of
the mmapped safetensors file while it is open) and ``RssAnon`` (the process's own allocations). ``load_peak_mb``
is the loader's own count (lazy only); ``kept`` the RSS after the load (what the layout keeps; under ZeRO-3 that
includes the wrapper's contiguous gradient buffer, 1/N of the model, allocated at construction even for a frozen
trainer; DDP's gradient buckets likewise: both reported as ``grads_mb``; freed memory the allocator keeps also
stays in it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

FIELDS = ("VmRSS", "RssAnon")


def status_mb() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in FIELDS:
            out[key] = int(line.split()[1]) / 1024
    return out


class Sampler(threading.Thread):
    """Peak of each /proc/self/status field, read every ``period_s``, until stopped."""

    def __init__(self, period_s: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.period_s, self.peak, self.done = period_s, status_mb(), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for k, v in status_mb().items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(self.period_s)

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.join(timeout=5)
        for k, v in status_mb().items():
            self.peak[k] = max(self.peak[k], v)
        return self.peak


def rank_load(rank: int, world_size: int, path: str, layout: dict, lazy: bool) -> dict:
    from spinwheel.models.hf import load_model
    from spinwheel.parallel import ParallelConfig, ParallelTrainer
    from spinwheel.parallel.io.lazy_load import load_figures

    before = status_mb()
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    model = load_model(path, lazy=lazy)
    trainer = ParallelTrainer(model, None, ParallelConfig(**layout))
    seconds = time.perf_counter() - t0
    peak, after = sampler.stop(), status_mb()
    result = {f"peak_{k}_mb": peak[k] - before[k] for k in FIELDS}
    result |= {f"kept_{k}_mb": after[k] - before[k] for k in FIELDS}
    module = trainer.pm.module  # the wrapper's gradient buffers (FSDP: contiguous, 1/N; DDP: buckets): not the load's
    buffers = [module.grads.flat] if hasattr(module, "grads") else [b.buffer for b in getattr(module, "_buckets", [])]
    grads_mb = sum(t.numel() * t.element_size() for t in buffers) / 2**20
    result |= {"load_s": seconds, "grads_mb": grads_mb, **load_figures(model)}
    del trainer
    return result


def write_checkpoint(path: Path, args: argparse.Namespace) -> tuple[float, int]:
    from spinwheel.models.config import ModelConfig
    from spinwheel.models.hf import save_pretrained
    from spinwheel.models.transformer import Transformer

    config = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(2.75 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=256,
    )
    model = Transformer(config).init_weights(0)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    save_pretrained(model, path, shard_size_bytes=nbytes // 2 + 1)
    return nbytes / 2**20, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from spinwheel.parallel import spawn

    with tempfile.TemporaryDirectory() as tmp:
        model_mb, params = write_checkpoint(Path(tmp), args)
        print(f"checkpoint: {params / 1e6:.1f}M parameters, {model_mb:.0f} MiB fp32 (2 shards + index)", flush=True)
        rows = []
        for name, layout in (("zero3", dict(zero=3)), ("tp2", dict(tp=2))):
            for lazy in (False, True):
                by_rank = spawn(rank_load, 2, args=(tmp, layout, lazy), timeout_s=900)
                for rank, r in enumerate(by_rank):
                    row = {"layout": name, "path": "lazy" if lazy else "old", "rank": rank, **r}
                    rows.append(row)
                    print(
                        f"{name:6s} {row['path']:4s} rank {rank}: peak VmRSS +{r['peak_VmRSS_mb']:7.0f} MiB, "
                        f"RssAnon +{r['peak_RssAnon_mb']:7.0f} MiB, kept +{r['kept_RssAnon_mb']:6.0f} MiB, "
                        f"loader peak {r.get('load_peak_mb', float('nan')):6.0f} MiB, grad buffer "
                        f"{r['grads_mb']:4.0f} MiB, {r['load_s']:.1f} s "
                        f"(model {model_mb:.0f} MiB)",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps({"model_mb": model_mb, "params": params, "rows": rows}, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
