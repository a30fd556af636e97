"""Tinker's built-in losses, per datum: token log-probs under the client's adapter -> the datum's loss sum.

Formulas as Tinker documents them (tinker-docs.thinkingmachines.ai/tinker/losses): with ``logp`` the learner's
log-probabilities of ``target_tokens`` (N,), every loss is a sum over the datum's tokens (no normalisation: a client
that wants a mean passes weights / advantages scaled by it):

    cross_entropy:        sum(-weights * logp)                                 weights default to 1
    importance_sampling:  sum(-exp(logp - q) * advantages)                     q = the sampler's logprobs
    ppo:                  sum(-min(r * A, clip(r, lo, hi) * A)),  r = exp(logp - q)   lo, hi = 0.8, 1.2 by default

Each is a pure function ``(logp, inputs, config) -> loss`` in a registry keyed by the name the client sends, with the
inputs and config keys it takes; anything else is a :class:`LossInputError` that fails the request alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class LossInputError(ValueError):
    """A request's loss name, inputs or config the service cannot use; the message says what to send instead."""


LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


@dataclass(frozen=True)
class Loss:
    fn: LossFn
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: tuple[tuple[str, float], ...] = ()  # accepted config keys and their defaults


def cross_entropy(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    weights = inputs.get("weights")
    return -(logp if weights is None else logp * weights).sum()


def importance_sampling(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def ppo(logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()


LOSSES: dict[str, Loss] = {
    "cross_entropy": Loss(cross_entropy, ("target_tokens",), ("weights",)),
    "importance_sampling": Loss(importance_sampling, ("target_tokens", "logprobs", "advantages"), ("weights",)),
    "ppo": Loss(
        ppo,
        ("target_tokens", "logprobs", "advantages"),
        ("weights",),
        (("clip_low_threshold", 0.8), ("clip_high_threshold", 1.2)),
    ),
}


def get_loss(name: str, config: dict[str, float] | None) -> tuple[Loss, dict[str, float]]:
    """The loss ``name`` and its full config (defaults filled in); an unknown name or key is a LossInputError."""
    loss = LOSSES.get(name)
    if loss is None:
        raise LossInputError(f"unknown loss_fn '{name}': this service implements {', '.join(LOSSES)}")
    known = dict(loss.config)
    extra = sorted(set(config or {}) - set(known))
    if extra:
        accepted = ", ".join(known) or "none"
        raise LossInputError(f"loss_fn_config key '{extra[0]}' is not used by '{name}' (it takes: {accepted})")
    return loss, {**known, **{k: float(v) for k, v in (config or {}).items()}}


def check_inputs(loss: Loss, name: str, inputs: dict, length: int, index: int) -> None:
    """Datum ``index``'s loss_fn_inputs against what ``loss`` takes: every required key, no unknown one, each a
    vector of the datum's ``length`` tokens."""
    missing = [k for k in loss.required if k not in inputs]
    if missing:
        raise LossInputError(f"datum {index}: loss_fn '{name}' needs loss_fn_inputs '{missing[0]}'")
    extra = sorted(set(inputs) - set(loss.required) - set(loss.optional))
    if extra:
        takes = ", ".join(loss.required + loss.optional)
        raise LossInputError(f"datum {index}: loss_fn_inputs '{extra[0]}' is not used by '{name}' (it takes: {takes})")
    for key, value in inputs.items():
        if tuple(value.shape) != (length,):
            raise LossInputError(
                f"datum {index}: loss_fn_inputs '{key}' has shape {list(value.shape)}, the model input has "
                f"{length} tokens: send one value per input token (shape [{length}])"
            )
