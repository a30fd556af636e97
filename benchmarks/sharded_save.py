"""Per-rank memory and time of a parallel learner's checkpoint save under a sharded layout (issue 26): the streamed
save (:mod:`spinwheel.parallel.io.streamed_save`: ``model.safetensors`` written tensor by tensor, each gathered to
rank 0 alone) against the gathering one it replaces (:func:`~spinwheel.train.parallel_checkpoint.save_gathered`:
the full state on every rank, a full ``Transformer`` on rank 0 for ``save_pretrained``).

    python benchmarks/sharded_save.py [--hidden 1024] [--layers 8] [--vocab 32000] [--json out.json]

A random fp32 model (~170M parameters by default) on 2 spawned ranks (gloo), ZeRO-3, tp 2 and pp 2, as a
``ParallelLearner`` without an engine copy (the RL loop's ``--engine-tp``); each (layout, path) runs in fresh rank
processes. glibc is told to map every allocation of 128 KiB or more on its own (``mallopt``) and the heap is
trimmed before the save, so that the resident set follows what is alive. A sampler thread reads
``/proc/self/status`` every millisecond; the figures are the peak over the save (HF files, ``trainer_state.pt`` and
the sharded trainer state) minus the value just before it: ``VmRSS`` and ``RssAnon`` (the process's own
allocations), beside the save's own count (``save_peak_mb``, streamed only) and its seconds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded_load import FIELDS, Sampler, status_mb  # noqa: E402  (the same /proc sampler as the load benchmark)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def model_config(args: argparse.Namespace):
    from spinwheel.models.config import ModelConfig

    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=256,
    )


def rank_save(rank: int, world_size: int, root: str, config, layout: dict, streamed: bool) -> dict:
    import gc

    from spinwheel.models.transformer import Transformer
    from spinwheel.parallel import ParallelConfig
    from spinwheel.train.learners import OptimConfig, ParallelLearner
    from spinwheel.train.parallel_checkpoint import save_gathered

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    learner = ParallelLearner(
        Transformer(config).init_weights(0), OptimConfig(lr=1e-4), ParallelConfig(**layout), engine_copy="none"
    )
    gc.collect()
    libc.malloc_trim(0)
    before, sampler = status_mb(), Sampler()
    sampler.start()
    t0 = time.perf_counter()
    ckpt = Path(root) / f"{'streamed' if streamed else 'gathered'}-{layout}"
    if streamed:
        learner.save(ckpt, None, {"step": 0})
    else:
        save_gathered(learner, ckpt, None, {"step": 0})
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    result = {f"peak_{k}_mb": peak[k] - before[k] for k in FIELDS} | {"save_s": seconds}
    if streamed:
        result |= learner.save_stats[rank]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from spinwheel.models.transformer import Transformer
    from spinwheel.parallel import spawn

    config = model_config(args)
    with torch.device("meta"):
        meta = Transformer(config)
    params = sum(p.numel() for p in meta.parameters())
    model_mb = params * 4 / 2**20
    print(f"model: {params / 1e6:.1f}M parameters, {model_mb:.0f} MiB fp32; 2 ranks (gloo)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, layout in (("zero3", dict(zero=3)), ("tp2", dict(tp=2)), ("pp2", dict(pp=2))):
            for streamed in (False, True):
                path = "streamed" if streamed else "gathered"
                by_rank = spawn(rank_save, 2, args=(root, config, layout, streamed), timeout_s=900)
                for rank, r in enumerate(by_rank):
                    rows.append({"layout": name, "path": path, "rank": rank, **r})
                    own = f", own count {r['save_peak_mb']:5.0f} MiB" if streamed else ""
                    print(
                        f"{name:5s} {path:8s} rank {rank}: peak VmRSS +{r['peak_VmRSS_mb']:5.0f} MiB, "
                        f"RssAnon +{r['peak_RssAnon_mb']:5.0f} MiB{own}, {r['save_s']:5.1f} s "
                        f"(model {model_mb:.0f} MiB)",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps({"model_mb": model_mb, "params": params, "rows": rows}, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
