"""``update_weights`` on the tensor-parallel engine: new full weights from a trainer, resharded by the driver.

The driver (rank 0) takes the full weights (a :class:`Transformer` or a state dict, on CPU or a device) and checks
every tensor against the full model's names and shapes before anything changes (:func:`checked_state`): an unknown
name is one device's one-line ``KeyError``, a wrong shape its ``RuntimeError`` ("size mismatch"), in one line, and
no rank has changed. A partial state dict updates what it names, as on one device. It then cuts each rank's slices
with the split start-up used (:func:`full_layout` runs :func:`~spinwheel.parallel.tensor.apply_tensor_parallel` on
the model on the meta device; each slice is ``chunk(N, dim)[r]``, as its ``_shard`` takes it — the chunk rule
:class:`~spinwheel.engine.tp_reshard.Resharder` applies to a trainer's full weights too), so the shards equal a fresh
engine's bit for bit.

Each worker is sent ONLY its own slices, as a message of its own (a :class:`~spinwheel.engine.tp_worker.Step` whose
``weights`` is set, sent now rather than with the next step) — not with the next step's one pickle for all, which
would carry every rank's slices to every worker and keep them on the driver until then. Each slice is copied into
storage of its own before pickling (a view would pickle its whole base tensor). The driver loads its own slices
while the workers load theirs, then waits for each worker's acknowledgement (at most ``timeout_s``), so when
``update_weights`` returns every rank holds the new weights; the steps that follow go down the same pipes, after it.
LoRA adapters being served keep their factors (their wrappers share the base's weight tensors, which are overwritten
in place), so they run over the new base. The caller then drops the prefix cache, as one device does.
"""

from __future__ import annotations

import pickle

import torch

from spinwheel.models.config import ModelConfig
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.tensor import apply_tensor_parallel

Layout = dict[str, tuple[torch.Size, int | None]]  # name -> (the full tensor's shape, the dim it is split on or None)


def full_layout(config: ModelConfig, axis: Axis, comm: Comm) -> Layout:
    """Every tensor of the full model (``config``, the whole model's): its shape, and the dim start-up's
    :func:`apply_tensor_parallel` splits it on (None: every rank holds it whole, e.g. the norms)."""
    with torch.device("meta"):
        model = Transformer(config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    dims = apply_tensor_parallel(model, axis, comm)
    return {name: (shape, dims.get(name)) for name, shape in shapes.items()}


def checked_state(model_or_state_dict: Transformer | dict[str, torch.Tensor], layout: Layout) -> dict:
    """The full weights to load, each checked against ``layout`` (one device's errors, in one line): a wrong shape
    is a ``RuntimeError`` (checked first, as ``load_state_dict`` raises it first), an unknown name a ``KeyError``."""
    if isinstance(model_or_state_dict, Transformer):
        state = {k: v for k, v in model_or_state_dict.state_dict().items() if not k.startswith("rotary.")}
    elif isinstance(model_or_state_dict, dict):
        state = dict(model_or_state_dict)
    else:
        raise TypeError(f"update_weights takes a Transformer or a state dict, got {type(model_or_state_dict).__name__}")
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"update_weights: '{name}' is a {type(t).__name__}, not a tensor")
        if name in layout and t.shape != layout[name][0]:
            want = tuple(layout[name][0])
            raise RuntimeError(
                f"update_weights: size mismatch for '{name}': {tuple(t.shape)} given, the model's is {want}"
            )
    unknown = [name for name in state if name not in layout]
    if unknown:
        raise KeyError(f"update_weights: unexpected tensor '{unknown[0]}'")
    return {k: v.detach() for k, v in state.items()}


def own_slices(state: dict[str, torch.Tensor], layout: Layout, n: int, r: int) -> dict[str, torch.Tensor]:
    """Rank ``r``'s slices (of ``n``) of ``state``: views, nothing copied."""
    return {k: t if layout[k][1] is None else t.chunk(n, dim=layout[k][1])[r] for k, t in state.items()}


def rank_slices(state: dict[str, torch.Tensor], layout: Layout, n: int, r: int, dtypes: dict) -> dict:
    """:func:`own_slices`, each copied into storage of its own on the CPU (a view would pickle its whole base) in
    the dtype of the shard's tensor (``dtypes``)."""
    return {k: torch.empty(t.shape, dtype=dtypes[k]).copy_(t) for k, t in own_slices(state, layout, n, r).items()}


@torch.no_grad()
def load_slices(model: Transformer, slices: dict[str, torch.Tensor]) -> int:
    """Copy this rank's ``slices`` into its shard, in place; returns the number of elements written."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in slices.items():
        params[name].copy_(t)
    return sum(t.numel() for t in slices.values())


def ship(conns: list, state: dict[str, torch.Tensor], layout: Layout, dtypes: dict, message) -> list[int]:
    """Send worker ``i`` (rank i + 1) ``message(its slices of state)``, one rank after the other (the driver holds
    one rank's copies at a time); returns each message's bytes."""
    sizes = []
    for rank, conn in enumerate(conns, 1):
        data = pickle.dumps(message(rank_slices(state, layout, len(conns) + 1, rank, dtypes)), protocol=5)
        conn.send_bytes(data)
        sizes.append(len(data))
        del data
    return sizes
