"""AdamW steps of several training clients at once: each client's gradients clipped by its own norm, then one fused
AdamW (``torch.optim.adamw.adamw(..., fused=True)`` where the device has it, else ``foreach``) over every client's
adapter parameters that share the same hyper-parameters.

AdamW is elementwise: parameter i's update reads only its own gradient, moments and step count, so one fused call
over the union of several clients' parameters computes for each exactly what a call over its parameters alone does
(the batched-equals-alone test checks it to 1e-6). The moments live in each client's ``torch.optim.AdamW`` state
(``optimizer.state[p]``: ``step``, ``exp_avg``, ``exp_avg_sq``, as torch keeps them), so ``save_state`` /
``load_state`` read and write the same ``optimizer.state_dict()`` as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw

from spinwheel.tinker.adapters import ClientAdapter


@dataclass(frozen=True)
class AdamHP:
    """One ``optim_step``'s Adam parameters (Tinker's AdamParams)."""

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


def _fused_ok(params: list[torch.Tensor]) -> bool:
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return all(p.dtype in dtypes for p in params) and len({p.device for p in params}) == 1


def _prepare(client: ClientAdapter, hp: AdamHP) -> tuple[list, list, list, list, list, float]:
    """Zero-fill missing gradients, clip by the client's own norm, set up torch's AdamW state; the step's lists."""
    params = list(client.params.values())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    clip = hp.grad_clip_norm if hp.grad_clip_norm > 0 else math.inf
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    opt = client.optimizer
    for group in opt.param_groups:  # recorded for save_state, as torch.optim.AdamW would hold them
        group.update(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
    grads, avgs, sqs, steps = [], [], [], []
    for p in params:
        state = opt.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grads.append(p.grad)
        avgs.append(state["exp_avg"])
        sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    return params, grads, avgs, sqs, steps, norm


def adamw_steps(requests: Sequence[tuple[ClientAdapter, AdamHP]]) -> list[dict]:
    """One AdamW step for each (client, hyper-parameters) — each client at most once — on the gradients it
    accumulated since its last step; then its gradients are cleared. Returns each client's step metrics."""
    if len({id(c) for c, _ in requests}) != len(requests):
        raise ValueError("adamw_steps: a client appears twice in one batch of steps")
    groups: dict[AdamHP, list[list]] = {}
    metrics = []
    for client, hp in requests:
        lists = _prepare(client, hp)
        merged = groups.setdefault(hp, [[], [], [], [], []])
        for into, part in zip(merged, lists[:5]):
            into.extend(part)
        metrics.append({"grad_norm:mean": lists[5], "learning_rate:mean": hp.lr})
    with torch.no_grad():
        for hp, (params, grads, avgs, sqs, steps) in groups.items():
            fused = _fused_ok(params)
            adamw(
                params, grads, avgs, sqs, [], steps,
                foreach=None if fused else True, fused=fused or None,
                amsgrad=False, beta1=hp.beta1, beta2=hp.beta2, lr=hp.lr,
                weight_decay=hp.weight_decay, eps=hp.eps, maximize=False,
            )  # fmt: skip
    for client, _ in requests:
        client.optimizer.zero_grad(set_to_none=True)
        client.num_steps += 1
    return metrics
