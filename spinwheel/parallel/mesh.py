"""The rank grid and its process groups.

Ranks are laid out on a 4-D grid ``pp × dp_replicate × dp_shard × tp`` (outermost to innermost), as picotron's
``arange(world).view(dp, pp, tp)`` and torchtitan's ``ParallelDims`` do: tensor-parallel peers are neighbours
(the most traffic, the fastest links), pipeline stages are the farthest apart. ``dp = dp_replicate × dp_shard``
is the data-parallel degree; hybrid sharding (HSDP) shards within ``dp_shard`` and replicates across
``dp_replicate``; plain DDP and ZeRO use the whole ``dp`` axis.

:class:`ParallelDims` is an explicit object passed to every wrapper (no global state). With ``world_size == 1`` every
axis has size 1, its ``group`` is ``None`` and the collectives in :mod:`spinwheel.parallel.comm` become local
copies, so the same code runs in one CPU process without ``torch.distributed`` being initialised.

Naming (torchtitan's rule): an *axis* is a direction of the rank grid; a *dim* is a tensor dimension.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spinwheel.parallel.comm import Comm

GRID_AXES = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost -> innermost


class ParallelError(ValueError):
    """A parallel layout that cannot run; the message says which degree to change."""


@dataclass(frozen=True)
class Axis:
    """This rank's group along one axis of the grid.

    ``ranks`` are the global ranks of the group in axis order, ``rank`` is this process's index in it and ``group``
    the process group (``None`` when the axis has size 1: nothing to communicate).
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    group: object | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]


def _local_axis(name: str) -> Axis:
    return Axis(name, (0,), 0, None)


class _AxisOf:
    """``dims.tp_axis`` and the like: the named axis of the process mesh (:meth:`ParallelDims.axis`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, dims: ParallelDims | None, owner: type) -> Axis:
        if dims is None:
            raise AttributeError(f"{self.name}_axis belongs to a ParallelDims instance")
        return dims.axis(self.name)


@dataclass
class ParallelDims:
    """Degrees of each parallel axis; ``dp_replicate × dp_shard × tp × pp`` must equal ``world_size``.

    Build with :meth:`create` (reads the world from ``torch.distributed`` and makes the process groups), or construct
    directly to validate a layout without any processes.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    rank: int = 0
    comm: Comm = field(default_factory=Comm, repr=False)
    axes: dict[str, Axis] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelError(f"parallel degree '{name}' must be a positive integer, got {value!r}")
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp
        if product != self.world_size:
            raise ParallelError(
                f"parallel degrees multiply to {product} (dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard}"
                f" × tp={self.tp} × pp={self.pp}) but the world has {self.world_size} processes; change the degrees "
                f"or launch {product} processes (torchrun --nproc-per-node {product})"
            )
        if not 0 <= self.rank < self.world_size:
            raise ParallelError(f"rank {self.rank} is outside the world of {self.world_size} processes")

    # ----------------------------------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        timeout_s: float | None = None,
        comm: Comm | None = None,
    ) -> ParallelDims:
        """Read the world from ``torch.distributed`` (size 1 when it is not initialised) and build the groups.

        ``dp_shard=-1`` takes whatever the other degrees leave.
        """
        initialised = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialised else 1
        rank = dist.get_rank() if initialised else 0
        if dp_shard == -1:
            rest = dp_replicate * tp * pp
            if world_size % rest:
                raise ParallelError(
                    f"dp_replicate × tp × pp = {rest} does not divide the world of {world_size} "
                    "processes; change the degrees"
                )
            dp_shard = world_size // rest
        dims = cls(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            tp=tp,
            pp=pp,
            world_size=world_size,
            rank=rank,
            comm=comm or Comm(),
        )
        dims.build_groups(timeout_s)
        return dims

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def grid(self) -> torch.Tensor:
        """Global ranks as a (pp, dp_replicate, dp_shard, tp) integer tensor."""
        return torch.arange(self.world_size).view(self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Grid coordinates of ``rank`` (default: this process), e.g. ``{"pp": 0, "dp_replicate": 0, ...}``."""
        rank = self.rank if rank is None else rank
        where = (self.grid() == rank).nonzero()[0].tolist()
        return dict(zip(GRID_AXES, where))

    def _groups_along(self, names: tuple[str, ...]) -> list[list[int]]:
        """All rank groups that vary along ``names`` (other coordinates fixed), each in axis order."""
        grid = self.grid()
        keep = [GRID_AXES.index(n) for n in names]
        rest = [i for i in range(len(GRID_AXES)) if i not in keep]
        size = 1
        for i in keep:
            size *= grid.shape[i]
        return grid.permute(*rest, *keep).reshape(-1, size).tolist()

    def build_groups(self, timeout_s: float | None = None) -> None:
        """Create one process group per (axis, slice). Every rank must call this in the same order."""
        spec = {
            "tp": ("tp",),
            "pp": ("pp",),
            "dp": ("dp_replicate", "dp_shard"),
            "dp_shard": ("dp_shard",),
            "dp_replicate": ("dp_replicate",),
        }
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        for name, along in spec.items():
            self.axes[name] = self._make_axis(name, self._groups_along(along), timeout)
        # First and last pipeline stage of each (dp, tp) column: they share tied embedding weights.
        ends = (
            [[g[0], g[-1]] for g in self._groups_along(("pp",))]
            if self.pp > 1
            else [[r] for r in range(self.world_size)]
        )
        self.axes["pp_ends"] = self._make_axis("pp_ends", ends, timeout)

    def _make_axis(self, name: str, groups: list[list[int]], timeout: datetime.timedelta | None) -> Axis:
        mine: Axis | None = None
        for ranks in groups:
            group = None
            if len(ranks) > 1:
                kwargs = {"timeout": timeout} if timeout is not None else {}
                group = dist.new_group(ranks, **kwargs)  # collective over the world: every rank creates every group
            if self.rank in ranks:
                mine = Axis(name, tuple(ranks), ranks.index(self.rank), group)
        assert mine is not None
        return mine

    def axis(self, name: str) -> Axis:
        if name not in self.axes:
            if self.world_size == 1:
                self.axes[name] = _local_axis(name)
            else:
                raise ParallelError("process groups are not built: call ParallelDims.create() or build_groups()")
        return self.axes[name]

    tp_axis = _AxisOf("tp")
    pp_axis = _AxisOf("pp")
    dp_axis = _AxisOf("dp")
    dp_shard_axis = _AxisOf("dp_shard")
    dp_replicate_axis = _AxisOf("dp_replicate")
    pp_ends_axis = _AxisOf("pp_ends")

    # ----------------------------------------------------------------------------------------------------------
    def validate_model(self, config) -> None:
        """Check that the model splits evenly: TP divides heads, KV heads, MLP width and vocabulary; PP ≤ layers."""
        checks = [
            ("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.num_key_value_heads),
            ("intermediate_size", config.intermediate_size),
            ("vocab_size", config.vocab_size),
        ]
        for key, value in checks:
            if value % self.tp:
                raise ParallelError(f"tp={self.tp} must divide the model's {key} ({value}); choose a tp that does")
        if self.pp > config.num_hidden_layers:
            raise ParallelError(
                f"pp={self.pp} exceeds the model's {config.num_hidden_layers} layers; use pp ≤ "
                f"{config.num_hidden_layers}"
            )
