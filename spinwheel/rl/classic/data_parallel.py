"""Data parallelism for the classic-control trainers: environments split over ranks, gradients summed each update.

Start-up and collectives are :mod:`spinwheel.parallel`'s: :func:`~spinwheel.parallel.launch.init_distributed`
joins the group torchrun describes (gloo: these tensors live on the CPU), a
:class:`~spinwheel.parallel.mesh.ParallelDims` whose data-parallel axis is the whole world names the group, and
its :class:`~spinwheel.parallel.comm.Comm` runs the collectives (counted, with timeouts). What stays here is the
classic trainers' own bookkeeping: which environments a rank steps and which samples of a global minibatch it holds.

Convention (it makes data parallelism exact rather than approximate): every rank computes its share of a
*global* mean, i.e. its local sum divided by the global sample count, and shares are **summed** across ranks.
A minibatch is one global index set, drawn identically on every rank from a shared seed; each rank keeps the
indices of the samples it holds. The sum of the ranks' gradients is then the single-process gradient of the
same minibatch, whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from spinwheel.parallel.comm import Comm
from spinwheel.parallel.launch import destroy_distributed, init_distributed
from spinwheel.parallel.mesh import Axis, ParallelDims, ParallelError


@dataclass
class DataParallel:
    """The data-parallel axis of ``dims``; with one process every collective is a local no-op (same code path)."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    owns_group: bool = False

    def __post_init__(self) -> None:
        if self.dims.dp != self.dims.world_size:
            raise ParallelError(f"classic RL is data parallel only; got tp={self.dims.tp}, pp={self.dims.pp}")

    @classmethod
    def launch(cls, timeout_s: float = 300.0) -> DataParallel:
        """Join the group torchrun describes (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR``); one process without."""
        initialised = dist.is_available() and dist.is_initialized()
        _, world_size = init_distributed("gloo", timeout_s=timeout_s)
        if world_size == 1:
            return cls()
        dims = ParallelDims.create(dp_replicate=world_size, dp_shard=1, timeout_s=timeout_s, comm=Comm(timeout_s))
        return cls(dims, owns_group=not initialised)

    @property
    def rank(self) -> int:
        return self.dims.rank

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def axis(self) -> Axis:
        return self.dims.dp_axis

    def shard(self, num_items: int) -> slice:
        """The contiguous block of ``num_items`` (e.g. environments) this rank holds."""
        if num_items % self.world_size:
            raise ValueError(
                f"{num_items} items do not split over {self.world_size} ranks; "
                "make num_envs a multiple of the number of processes"
            )
        size = num_items // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def sum(self, x: Tensor) -> Tensor:
        """Sum of ``x`` over ranks (a new tensor; ``x`` is untouched)."""
        if self.world_size == 1:
            return x
        out = x.detach().clone()
        self.dims.comm.all_reduce(out, self.axis)
        return out

    def sum_(self, x: Tensor) -> Tensor:
        """Sum ``x`` over ranks in place (e.g. a flat gradient buffer: one collective for all parameters)."""
        self.dims.comm.all_reduce(x, self.axis)
        return x

    def gather(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` ``(n, ...)`` concatenated in rank order: ``(world_size * n, ...)``."""
        if self.world_size == 1:
            return x
        return torch.cat(self.dims.comm.all_gather_list(x.detach(), self.axis))

    def local_indices(self, indices: Tensor, num_envs: int) -> Tensor:
        """This rank's part of a global index set over a ``(T, num_envs)`` time-major rollout.

        ``indices`` address the flattened global rollout (sample ``t * num_envs + i``); the result addresses
        this rank's flattened local rollout ``(T, num_envs / world_size)``, in the same order.
        """
        if self.world_size == 1:
            return indices
        num_local = num_envs // self.world_size
        step, env = indices // num_envs, indices % num_envs
        local_env = env - self.rank * num_local
        mine = (local_env >= 0) & (local_env < num_local)
        return step[mine] * num_local + local_env[mine]

    def mean_std(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and (unbiased) std of ``x`` over all ranks' elements, in float64."""
        if self.world_size == 1:
            std, mean = torch.std_mean(x.detach().to(torch.float64))
            return mean, std
        x = x.detach().to(torch.float64)
        n, total, squares = self.sum(
            torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), x.pow(2).sum()])
        )
        mean = total / n
        var = (squares - n * mean * mean) / (n - 1).clamp(min=1.0)
        return mean, var.clamp(min=0.0).sqrt()

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's ``x`` on every rank (in place)."""
        self.dims.comm.broadcast(x, self.axis, src=0)
        return x

    def close(self) -> None:
        if self.owns_group:
            destroy_distributed()
            self.owns_group = False
