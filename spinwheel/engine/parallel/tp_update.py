"""``update_weights`` on the tensor-parallel engine: new full weights from a trainer, resharded by the driver.

The driver (rank 0) takes the full weights (a :class:`Transformer` or a state dict, on CPU or a device) and checks
every tensor against the full model's names and shapes before anything changes (:func:`checked_state`): an unknown
name is one device's one-line ``KeyError``, a wrong shape its ``RuntimeError`` ("size mismatch"), in one line, and
no rank has changed. A partial state dict updates what it names, as on one device. It then cuts each rank's slices
with the split start-up used (:func:`full_layout` runs :func:`~spinwheel.parallel.tensor.apply_tensor_parallel` on
the model on the meta device; each slice is ``chunk(N, dim)[r]``, as its ``_shard`` takes it — the chunk rule
:class:`~spinwheel.engine.parallel.tp_reshard.Resharder` applies to a trainer's full weights too), so the shards equal
a fresh
engine's bit for bit.

Each worker is sent ONLY its own slices, as a message of its own rather than with the next step (whose one pickle
goes to every worker, and which would keep every rank's slices on the driver until then): a
:class:`~spinwheel.engine.parallel.tp_worker.Step` whose ``weights`` lists the slices' names, shapes and dtypes, then
each
slice's bytes as a raw pipe message (:func:`ship`), which the worker reads straight into its weight
(:func:`receive_slices`). No pickling of tensors (torch pickles a view with its whole base storage, through
``torch.save``): a slice that is already a contiguous CPU block in the shard's dtype (vocabulary rows, the
column-parallel weights' rows) goes out of the caller's memory as it is, the others through one copy, one tensor at
a time, so the driver never holds another rank's shard. The driver loads its own slices after sending, then waits
for each worker's acknowledgement (at most ``timeout_s``), so when ``update_weights`` returns every rank holds the
new weights; the steps that follow go down the same pipes, after it. LoRA adapters being served keep their factors
(their wrappers share the base's weight tensors, which are overwritten in place), so they run over the new base.
The caller then drops the prefix cache, as one device does.
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


def untied(state: dict[str, torch.Tensor], model: Transformer) -> dict[str, torch.Tensor]:
    """``state`` less the names of a tied weight (the LM head sharing the embedding) whose tensor is one it holds
    already under the weight's first name: it is sent and loaded once."""
    first: dict[int, str] = {}
    aliases = {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    return {
        k: t
        for k, t in state.items()
        if aliases[k] == k or aliases[k] not in state or state[aliases[k]].data_ptr() != t.data_ptr()
    }


def own_slices(state: dict[str, torch.Tensor], layout: Layout, n: int, r: int) -> dict[str, torch.Tensor]:
    """Rank ``r``'s slices (of ``n``) of ``state``: views, nothing copied."""
    return {k: t if layout[k][1] is None else t.chunk(n, dim=layout[k][1])[r] for k, t in state.items()}


def raw(t: torch.Tensor):
    """The bytes of contiguous CPU tensor ``t`` as a writable buffer over its memory (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def ship(conns: list, state: dict[str, torch.Tensor], layout: Layout, dtypes: dict, message) -> list[int]:
    """Send worker ``i`` (rank i + 1) ``message(manifest)`` (its slices' names, shapes and dtypes), then each
    slice's bytes as a raw message of its own: a slice of a contiguous CPU tensor in the shard's dtype goes out of
    the caller's memory as it is (the embedding's rows, the column-parallel weights), the others (the row-parallel
    weights' columns, another dtype or device) through one copy, one tensor at a time. Returns each worker's bytes."""
    sizes = []
    for rank, conn in enumerate(conns, 1):
        parts = own_slices(state, layout, len(conns) + 1, rank)
        head = pickle.dumps(message([(k, tuple(t.shape), dtypes[k]) for k, t in parts.items()]))
        conn.send_bytes(head)
        sent = len(head)
        for name, t in parts.items():
            if t.device.type != "cpu" or t.dtype != dtypes[name] or not t.is_contiguous():
                t = torch.empty(t.shape, dtype=dtypes[name]).copy_(t)
            data = raw(t)
            conn.send_bytes(data)
            sent += data.nbytes
        sizes.append(sent)
    return sizes


@torch.no_grad()
def receive_slices(conn, model: Transformer, manifest: list[tuple[str, tuple[int, ...], torch.dtype]]) -> int:
    """On a worker: read the slices ``manifest`` announces from ``conn`` into the shard, in place (straight into a
    contiguous CPU weight, else through a buffer); returns the number of elements written."""
    params = dict(model.named_parameters(remove_duplicate=False))
    written = 0
    for name, shape, dtype in manifest:
        dst = params[name]
        direct = dst.device.type == "cpu" and dst.dtype == dtype and dst.is_contiguous()
        buf = dst if direct else torch.empty(shape, dtype=dtype)
        conn.recv_bytes_into(raw(buf))
        if not direct:
            dst.copy_(buf)
        written += buf.numel()
    return written


@torch.no_grad()
def load_slices(model: Transformer, slices: dict[str, torch.Tensor]) -> int:
    """Copy the driver's ``slices`` into its shard, in place; returns the number of elements written."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in slices.items():
        params[name].copy_(t)
    return sum(t.numel() for t in slices.values())
