"""Data parallelism for the classic-control trainers: one gloo process group, gradients summed each update.

A stop-gap until the project's parallel layer (``spinwheel.parallel``) lands; the trainers only use the
methods of :class:`DataParallel`, so it can be swapped for that layer's object.

Convention (it makes data parallelism exact rather than approximate): every rank computes its share of a
*global* mean, i.e. its local sum divided by the global sample count, and shares are **summed** across ranks.
A minibatch is one global index set, drawn identically on every rank from a shared seed; each rank keeps the
indices of the samples it holds. The sum of the ranks' gradients is then the single-process gradient of the
same minibatch, whatever the split.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class DataParallel:
    """Rank and world size of a data-parallel group; with ``world_size == 1`` every method is a no-op."""

    rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @classmethod
    def from_torchrun_env(cls, timeout_s: float = 300.0) -> DataParallel:
        """Join the group torchrun describes in ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` (gloo backend).

        Without those variables (a plain ``python`` run) this is a one-process group.
        """
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        rank = int(os.environ["RANK"])
        if dist.is_initialized():
            return cls(rank=dist.get_rank(), world_size=dist.get_world_size())
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank=rank, world_size=world_size, owns_group=True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, num_items: int) -> slice:
        """The contiguous block of ``num_items`` (e.g. environments) this rank holds."""
        if num_items % self.world_size:
            raise ValueError(f"{num_items} items do not split over {self.world_size} ranks; "
                             "make num_envs a multiple of the number of processes")
        size = num_items // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def sum(self, x: Tensor) -> Tensor:
        """Sum of ``x`` over ranks (a new tensor; ``x`` is untouched)."""
        if self.world_size == 1:
            return x
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def sum_(self, x: Tensor) -> Tensor:
        """Sum ``x`` over ranks in place (e.g. a flat gradient buffer: one collective for all parameters)."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

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
        n, total, squares = self.sum(torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64),
                                                  x.sum(), x.pow(2).sum()]))
        mean = total / n
        var = (squares - n * mean * mean) / (n - 1).clamp(min=1.0)
        return mean, var.clamp(min=0.0).sqrt()

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's ``x`` on every rank (in place)."""
        if self.world_size > 1:
            dist.broadcast(x, src=0)
        return x

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
