"""What a loss sees of the model's output, per token, under any layout: log-probabilities of the labels (with
gradient), optionally the policy's entropy (detached), or the values of a scalar-head model (critic, reward model).

Under tensor parallelism the logits are vocabulary-sharded (..., V/tp) and are never gathered: the label's
log-probability is minus the vocab-parallel cross-entropy (Megatron's), and the entropy ``H = lse − Σ p·logit`` is
assembled from three reductions over the tensor-parallel axis (max, partition function, Σ p·logit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.tensor import vocab_parallel_cross_entropy


@dataclass
class TokenOutputs:
    """Per-token model outputs for a (micro-)batch of rows (b, T); fields a head does not produce are None."""

    logprobs: torch.Tensor | None = None  # (b, T) fp32: log π(labels[:, t] | input_ids[:, :t+1]), with gradient
    entropy: torch.Tensor | None = None  # (b, T) fp32 entropy of π(· | input_ids[:, :t+1]), detached
    values: torch.Tensor | None = None  # (b, T) fp32 outputs of a scalar-head model, with gradient


def is_scalar_head(config) -> bool:
    """Whether a model config describes a scalar-output model (a critic or reward model: ``num_labels == 1``)."""
    return getattr(config, "num_labels", None) == 1


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, axis: Axis, comm: Comm) -> torch.Tensor:
    """Entropy (fp32) of softmax(logits) over the full vocabulary from vocab-sharded logits (..., V/tp) -> (...)."""
    z = logits.float()
    if axis.size == 1:
        logp = F.log_softmax(z, dim=-1)
        return -(logp.exp() * logp).sum(-1)
    m = z.amax(dim=-1)
    comm.all_reduce(m, axis, op=dist.ReduceOp.MAX)
    e = (z - m.unsqueeze(-1)).exp()
    sums = torch.stack([e.sum(-1), (e * z).sum(-1)])  # partition function and Σ exp·logit, reduced together
    comm.all_reduce(sums, axis)
    lse = m + sums[0].log()
    return lse - sums[1] / sums[0]


def token_outputs(
    out: torch.Tensor, labels: torch.Tensor, tp_axis: Axis, comm: Comm, *, scalar_head: bool, entropy: bool = False
) -> TokenOutputs:
    """Turn the model's output (b, T, V or V/tp; (b, T, 1) for a scalar head) into :class:`TokenOutputs`. Without
    gradients (old / reference log-probs) a row at a time: the fp32 copies log-softmax and the entropy make are one
    row's, not the batch's (every tensor-parallel rank has the same rows: the collectives stay matched)."""
    if scalar_head:
        return TokenOutputs(values=out[..., 0].float())
    if not torch.is_grad_enabled() and out.dim() == 3 and out.shape[0] > 1:
        parts = [
            token_outputs(out[i : i + 1], labels[i : i + 1], tp_axis, comm, scalar_head=False, entropy=entropy)
            for i in range(out.shape[0])
        ]
        return TokenOutputs(
            logprobs=torch.cat([p.logprobs for p in parts]),  # type: ignore[misc]
            entropy=torch.cat([p.entropy for p in parts]) if entropy else None,  # type: ignore[misc]
        )
    logprobs = -vocab_parallel_cross_entropy(out, labels, tp_axis, comm)
    return TokenOutputs(logprobs=logprobs, entropy=vocab_parallel_entropy(out, tp_axis, comm) if entropy else None)
