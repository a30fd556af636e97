"""Distributed training on ``torch.distributed``: collectives → module wrappers → schedules.

* :mod:`~spinwheel.parallel.mesh` — :class:`ParallelDims`, the rank grid and its process groups;
* :mod:`~spinwheel.parallel.comm` — collectives with ZeRO-style volume counters and timeouts;
* :mod:`~spinwheel.parallel.data.ddp`, :mod:`~spinwheel.parallel.data.zero`, :mod:`~spinwheel.parallel.data.fsdp` —
data parallelism
  (DDP, ZeRO-1/2, FSDP = ZeRO-3, HSDP);
* :mod:`~spinwheel.parallel.tensor` — Megatron tensor parallelism; :mod:`~spinwheel.parallel.pipeline` — GPipe / 1F1B;
  :mod:`~spinwheel.parallel.remat` — activation re-materialisation;
* :mod:`~spinwheel.parallel.parallelize` — applies them in order; :mod:`~spinwheel.parallel.trainer` — the parallel
  trainer (pluggable per-token losses, forward-only log-probs); :mod:`~spinwheel.parallel.config` — the layout
  options; :mod:`~spinwheel.parallel.optim` — global gradient-norm clipping and name-selected weight decay across
  shards; :mod:`~spinwheel.parallel.io.checkpoint` — sharded save/resume and HF consolidation;
  :mod:`~spinwheel.parallel.launch` — torchrun start-up and local spawning.
"""

from spinwheel.parallel.comm import Comm, CommStats
from spinwheel.parallel.config import ParallelConfig
from spinwheel.parallel.launch import init_distributed, spawn
from spinwheel.parallel.mesh import Axis, ParallelDims, ParallelError
from spinwheel.parallel.parallelize import ParallelModel, parallelize
from spinwheel.parallel.trainer import ParallelTrainer

__all__ = [
    "Axis",
    "Comm",
    "CommStats",
    "ParallelConfig",
    "ParallelDims",
    "ParallelError",
    "ParallelModel",
    "ParallelTrainer",
    "init_distributed",
    "parallelize",
    "spawn",
]
