"""A checkpointed region that may span several module calls (the mechanism under :mod:`~spinwheel.parallel.remat`).

Re-materialisation (Chen et al., 2016) keeps a region's input and recomputes what the region saved for backward
when backward first needs it. ``torch.utils.checkpoint`` does this for one function call; a segment of k blocks,
though, is k separate calls from the model's own loop, each wrapped by the data-parallel hooks (FSDP gathers a
block's parameters around its call). So the region here is opened by the first call and closed by the last, and
the blocks run exactly as they would without it — same hooks, same collectives — while autograd's saved tensors
inside are replaced by indices (``torch.autograd.graph.saved_tensors_hooks``):

* **forward**: the region saves its input through autograd (on a node off the gradient path, so memory accounting
  and other hooks see exactly what is kept) — whole, or partitioned across the TP group
  (:mod:`~spinwheel.parallel.remat_partition`); every tensor saved inside becomes its index;
* **backward**: the first unpack rebuilds the input, re-runs the region under enable_grad with a hook that
  collects what the recomputation saves, in the same order, checks the count and shapes against the forward's, and
  hands each tensor out once (then drops it, so memory falls as backward proceeds). A second backward over a
  retained graph recomputes again (keyed by the graph task).

The region's code must be deterministic: recomputation must save the same tensors in the same order (the
transformer blocks have no dropout, so no RNG state is replayed). Non-tensor arguments (an attention mask object)
are kept by reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

_saved_tensors_hooks = torch.autograd.graph.saved_tensors_hooks


class InputStore(Protocol):
    """Whole or partitioned (see :mod:`~spinwheel.parallel.remat_partition`); ``copies_input``: whether what
    :meth:`pack` keeps is a copy, so the caller may free the input's own storage."""

    copies_input: bool

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, object]: ...

    def unpack(self, saved: torch.Tensor, meta: object) -> torch.Tensor: ...


class _SaveInputs(torch.autograd.Function):
    """Saves the region's input tensors on a node of their own; its (empty) output is never used."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError("the re-materialisation input saver is not part of any gradient path")


class CheckpointRegion:
    """One forward of a region: ``args`` are the region's inputs (``args[0]``, the activation, goes through
    ``store``; other tensors are saved whole), ``run(*args)`` recomputes it. Use :meth:`enter` / :meth:`exit`
    around the region's forward (they may be called from different functions)."""

    def __init__(self, run: Callable[..., object], store: InputStore, args: tuple) -> None:
        if not isinstance(args[0], torch.Tensor):
            raise TypeError("a re-materialised region's first argument must be its input activation tensor")
        self._run, self._store = run, store
        self._is_tensor = [isinstance(a, torch.Tensor) for a in args]
        self._requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        self._others = [None if t else a for a, t in zip(args, self._is_tensor)]
        stored, self._meta = store.pack(args[0])
        tensors = [stored] + [a.detach() for a, t in zip(args[1:], self._is_tensor[1:]) if t]
        anchor = torch.empty(0, requires_grad=True)
        self._saver = _SaveInputs.apply(anchor, *tensors).grad_fn
        self._forward_saved: list[tuple[torch.Size, torch.dtype]] = []
        self._recomputed: dict[int, dict[int, torch.Tensor]] = {}
        self._hooks: _saved_tensors_hooks | None = None

    def enter(self) -> None:
        self._hooks = _saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def exit(self) -> None:
        # Dropping the hooks object breaks the cycle region → hooks → bound methods → region: afterwards only the
        # graph's saved tensors hold the region, so it (and what it keeps) is freed as soon as autograd lets go.
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)

    @property
    def num_saved(self) -> int:
        """How many tensors the region's forward saved (each replaced by its index)."""
        return len(self._forward_saved)

    def _pack(self, t: torch.Tensor) -> int:
        self._forward_saved.append((t.shape, t.dtype))
        return len(self._forward_saved) - 1

    def _unpack(self, index: int) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        tensors = self._recomputed.get(task)
        if tensors is None:
            tensors = self._recomputed[task] = self._recompute()
        if index not in tensors:
            raise RuntimeError(
                "re-materialisation: a saved activation was unpacked twice in one backward; read a custom "
                "Function's ctx.saved_tensors once"
            )
        return tensors.pop(index)

    def _inputs(self) -> list:
        saved = list(self._saver.saved_tensors)
        first = self._store.unpack(saved.pop(0), self._meta)
        args = []
        for i, (is_tensor, other) in enumerate(zip(self._is_tensor, self._others)):
            if not is_tensor:
                args.append(other)
                continue
            t = first if i == 0 else saved.pop(0)
            args.append(t.detach().requires_grad_(self._requires_grad[i]))
        return args

    def _recompute(self) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            out[len(out)] = t.detach() if t.requires_grad else t
            return t

        with torch.enable_grad(), _saved_tensors_hooks(pack, lambda t: t):
            self._run(*self._inputs())
        got = [(t.shape, t.dtype) for t in out.values()]
        if got != self._forward_saved:
            raise RuntimeError(
                f"re-materialisation: the recomputation saved {len(got)} tensors where the forward saved "
                f"{len(self._forward_saved)} (or their shapes differ): the region is not deterministic"
            )
        return out
