"""Megatron-style tensor parallelism (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism").

The two conjugate operators of the paper (§3, Fig. 3), and the pair that moves a tensor between its replicated and
last-dim-sharded forms:

* ``f`` = :func:`copy_to_tp` — identity forward, all-reduce backward (enters a tensor-parallel region);
* ``g`` = :func:`reduce_from_tp` — all-reduce forward, identity backward (leaves it);
* :func:`gather_from_tp` — all-gather of the last dim forward, this rank's slice of the gradient backward;
* :func:`scatter_to_tp` — this rank's slice of the last dim forward, all-gather of the gradient backward.

A column-parallel linear holds a slice of the output features (``f`` then a local matmul; its output stays sharded
unless ``gather_output``); a row-parallel linear holds a slice of the input features (local matmul then ``g``; the
bias is added once, after the reduction; a replicated input is split first unless ``input_is_parallel``). Both
work on their own, built from the dense ``nn.Linear`` they replace.

In a block, attention is split by heads — q, k and v column-parallel (query and key/value heads alike, so
grouped-query attention keeps its grouping), ``o_proj`` row-parallel — and the MLP column-then-row. The column
layers of a sub-layer read the same input, so they share one ``f``, applied to the sub-layer's input by a forward
pre-hook (:func:`enter_tp_region`, torchtitan's ``PrepareModuleInput``) instead of one per projection: the
gradients of q, k and v (of gate and up) are summed locally first, then all-reduced once. A block thus costs two
all-reduces of its activation (B, T, C) forward (``g`` after ``o_proj`` and ``down_proj``) and two backward (``f``
before attention and before the MLP), as Megatron's fused QKV and gate/up GEMMs do. The embedding is vocab-parallel
(each rank holds V/tp rows, out-of-range tokens give zeros, ``g`` sums), the head is column-parallel over the
vocabulary and :func:`vocab_parallel_cross_entropy` computes the loss from the sharded logits without gathering
them (two small all-reduces of (N,) and (2, N) forward, none backward).

:func:`apply_tensor_parallel` swaps these layers into a :class:`~spinwheel.models.transformer.Transformer` from the
outside and keeps parameter names, so checkpoints map one to one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.parallel.comm import Comm, ReduceOp
from spinwheel.parallel.mesh import Axis


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis, comm):
        ctx.axis, ctx.comm = axis, comm
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, ctx.axis)
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, axis, comm):
        x = x.contiguous().clone()
        comm.all_reduce(x, axis)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather of the last dim forward (..., n/tp) -> (..., n); this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis, comm):
        ctx.axis = axis
        return torch.cat(comm.all_gather_list(x, axis), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.axis.size, dim=-1)[ctx.axis.rank].contiguous(), None, None


class _ScatterToTP(torch.autograd.Function):
    """This rank's slice of the last dim forward (..., n) -> (..., n/tp); all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis, comm):
        ctx.axis, ctx.comm = axis, comm
        return x.chunk(axis.size, dim=-1)[axis.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return torch.cat(ctx.comm.all_gather_list(grad, ctx.axis), dim=-1), None, None


def copy_to_tp(x: torch.Tensor, axis: Axis, comm: Comm) -> torch.Tensor:
    return _CopyToTP.apply(x, axis, comm) if axis.size > 1 else x


def reduce_from_tp(x: torch.Tensor, axis: Axis, comm: Comm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, axis, comm) if axis.size > 1 else x


def gather_from_tp(x: torch.Tensor, axis: Axis, comm: Comm) -> torch.Tensor:
    return _GatherFromTP.apply(x, axis, comm) if axis.size > 1 else x


def scatter_to_tp(x: torch.Tensor, axis: Axis, comm: Comm) -> torch.Tensor:
    return _ScatterToTP.apply(x, axis, comm) if axis.size > 1 else x


def _shard(t: torch.Tensor, dim: int, axis: Axis) -> nn.Parameter:
    """This rank's slice of ``t`` as a parameter, trainable as ``t`` is (a LoRA run's base stays frozen)."""
    return nn.Parameter(t.detach().chunk(axis.size, dim=dim)[axis.rank].clone(), requires_grad=t.requires_grad)


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = f(x) @ W[out/tp, in]ᵀ + b[out/tp], built from the dense ``linear`` (W (out, in)) it shards.

    ``gather_output``: all-gather y to (..., out) on every rank (else it stays sharded on its last dim, as a
    following row-parallel layer wants it). ``copy_input=False`` leaves ``f`` out: the caller applied one ``f`` to
    an input several column layers share (:func:`enter_tp_region`); without it the input gradient is partial.
    """

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(
        self, linear: nn.Linear, axis: Axis, comm: Comm, *, gather_output: bool = False, copy_input: bool = True
    ) -> None:
        super().__init__()
        if linear.out_features % axis.size:
            raise ValueError(f"tp={axis.size} must divide out_features ({linear.out_features})")
        self.axis, self.comm = axis, comm
        self.gather_output, self.copy_input = gather_output, copy_input
        self.weight = _shard(linear.weight, 0, axis)
        self.bias = _shard(linear.bias, 0, axis) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.axis, self.comm) if self.copy_input else x
        y = F.linear(x, self.weight, self.bias)  # (..., out/tp)
        return gather_from_tp(y, self.axis, self.comm) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = g(x[..., in/tp] @ W[out, in/tp]ᵀ) + b, built from the dense ``linear`` (W (out, in)) it shards; the
    output is replicated.

    ``input_is_parallel``: x arrives sharded on its last dim (a column-parallel layer's output); else x (..., in) is
    replicated and this rank's slice is taken first (its gradient all-gathered back to (..., in)).
    """

    shard_dims = {"weight": 1}

    def __init__(self, linear: nn.Linear, axis: Axis, comm: Comm, *, input_is_parallel: bool = True) -> None:
        super().__init__()
        if linear.in_features % axis.size:
            raise ValueError(f"tp={axis.size} must divide in_features ({linear.in_features})")
        self.axis, self.comm = axis, comm
        self.input_is_parallel = input_is_parallel
        self.weight = _shard(linear.weight, 1, axis)
        bias = linear.bias
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.input_is_parallel else scatter_to_tp(x, self.axis, self.comm)  # (..., in/tp)
        y = reduce_from_tp(F.linear(x, self.weight), self.axis, self.comm)
        return y + self.bias if self.bias is not None else y


def enter_tp_region(module: nn.Module, axis: Axis, comm: Comm) -> None:
    """Apply ``f`` once to ``module``'s first input (a forward pre-hook), for the column layers inside it that
    share that input and were built with ``copy_input=False``: their input gradients add up locally and are
    all-reduced once."""
    if axis.size == 1:
        return

    def hook(mod: nn.Module, args: tuple) -> tuple:
        return (copy_to_tp(args[0], axis, comm), *args[1:])

    module.register_forward_pre_hook(hook)


class VocabParallelEmbedding(nn.Module):
    """Rows [r·V/tp, (r+1)·V/tp) of the embedding; tokens outside give zeros and ``g`` sums the ranks."""

    shard_dims = {"weight": 0}

    def __init__(self, embedding: nn.Embedding, axis: Axis, comm: Comm) -> None:
        super().__init__()
        self.axis, self.comm = axis, comm
        self.weight = _shard(embedding.weight, 0, axis)
        self.vocab_start = axis.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.axis, self.comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, axis, comm):
        # logits (N, V/tp) this rank's vocabulary slice; targets (N,) global token ids.
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, axis, op=ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        local = targets - vocab_start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~inside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([target_logit, sum_exp])  # one all-reduce for both sums
        comm.all_reduce(both, axis)
        target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit  # (N,)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, inside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local] -= inside.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, axis: Axis, comm: Comm) -> torch.Tensor:
    """Per-token cross-entropy (fp32) from vocab-sharded logits (..., V/tp) and targets (...) -> (...).

    Rank r holds vocabulary slice r; the max, the partition function and the target logit are each reduced over
    the tensor-parallel axis, so the full (..., V) logits never exist on any rank.
    """
    shape = targets.shape
    if axis.size == 1:
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        ).view(shape)
    vocab_start = axis.rank * logits.shape[-1]
    loss = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), vocab_start, axis, comm
    )
    return loss.view(shape)


# Sub-layer -> its column-parallel projections (sharing the sub-layer's input and one f), its row-parallel one.
_SUBLAYERS = {
    "self_attn": (("q_proj", "k_proj", "v_proj"), "o_proj"),
    "mlp": (("gate_proj", "up_proj"), "down_proj"),
}


LayerSwap = Callable[[nn.Linear, Axis, Comm], nn.Module]  # a dense projection -> its tensor-parallel layer


def column_layer(linear: nn.Linear, axis: Axis, comm: Comm) -> nn.Module:
    return ColumnParallelLinear(linear, axis, comm, copy_input=False)


def row_layer(linear: nn.Linear, axis: Axis, comm: Comm) -> nn.Module:
    return RowParallelLinear(linear, axis, comm)


def apply_tensor_parallel(
    model: nn.Module, axis: Axis, comm: Comm, column: LayerSwap = column_layer, row: LayerSwap = row_layer
) -> dict[str, int]:
    """Swap a Transformer's (or pipeline stage's) layers for tensor-parallel ones, in place: ``column`` builds
    q, k, v, gate and up (sharing their sub-layer's ``f``), ``row`` o and down (LoRA-aware ones:
    :mod:`~spinwheel.parallel.tensor_lora`).

    Returns the sharded parameters' names with the dim they are split on (for checkpoint consolidation).
    Blocks are found under ``model.layers`` (a ModuleList, or a ModuleDict keyed by the original layer index).
    """
    shard_dims: dict[str, int] = {}
    if axis.size == 1:
        return shard_dims
    layers = model.layers
    items = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    for idx, block in items:
        for sub_name, (columns, row_name) in _SUBLAYERS.items():
            sub = getattr(block, sub_name)
            new: dict[str, nn.Module] = {name: column(getattr(sub, name), axis, comm) for name in columns}
            new[row_name] = row(getattr(sub, row_name), axis, comm)
            for name, layer in new.items():
                setattr(sub, name, layer)
                params = dict(layer.named_parameters())
                for pname, dim in layer.shard_dims.items():
                    if pname in params:
                        shard_dims[f"layers.{idx}.{sub_name}.{name}.{pname}"] = dim
            enter_tp_region(sub, axis, comm)
    tied = (
        getattr(model, "embed_tokens", None) is not None
        and getattr(model, "lm_head", None) is not None
        and model.lm_head.weight is model.embed_tokens.weight
    )
    if getattr(model, "embed_tokens", None) is not None:
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, axis, comm)
        shard_dims["embed_tokens.weight"] = 0
    # A scalar (reward / value) head has one output row: it stays whole on every rank, as the final norm does.
    if getattr(model, "lm_head", None) is not None and getattr(model.config, "num_labels", None) is None:
        model.lm_head = ColumnParallelLinear(model.lm_head, axis, comm)
        if tied:  # the embedding's rows and the head's output features are the same vocabulary slice
            model.lm_head.weight = model.embed_tokens.weight
        shard_dims["lm_head.weight"] = 0
    return shard_dims
