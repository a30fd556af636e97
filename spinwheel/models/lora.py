"""LoRA: low-rank adapters on the decoder's linear projections.

Reference: Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; the conventions (scaling,
initialisation, dropout placement, file format) are PEFT's, so an adapter trained here loads in ``peft`` (see
``lora_io.py``) with the same outputs. rsLoRA (Kalajdzievski, 2023) scales by ``alpha / sqrt(r)`` instead.

A targeted projection with weight W (out, in) and bias b computes, for x (..., in),

    y = x W^T + b + s * dropout(x) A^T B^T,    A (r, in), B (out, r), s = alpha / r

A is drawn kaiming-uniform (a = sqrt 5, as ``nn.Linear`` and PEFT do) and B starts at zero, so a fresh adapter leaves
the model's outputs unchanged. The base is frozen: only A and B require gradients, so an optimizer built from the
trainable parameters holds state for the adapters alone.

A wrapped projection keeps its ``weight`` / ``bias`` names (the very same Parameter objects) and adds
``lora_A.weight`` / ``lora_B.weight``: the base checkpoint's names are unchanged, and an adapter tensor's PEFT name is
``base_model.model.`` + its HF name. :func:`adapters_disabled` switches every adapter off (the reference policy is
the base with adapters off, with no second copy of the model); :func:`merge` folds them into the base weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

# Short target name -> the projection's path inside a decoder block (HF Llama's module names).
TARGETS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
ALL_TARGETS = tuple(TARGETS)


class LoRAError(ValueError):
    """A LoRA setting or adapter file spinwheel cannot use; the message names the cause and what to change."""


def parse_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """``"q,k,v"``, ``["q_proj", "v_proj"]`` or ``"all-linear"`` -> short names in canonical order (q k v o gate up
    down). Both spinwheel's short names and HF's module names are accepted; anything else is a :class:`LoRAError`."""
    names = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [n.strip() for n in names if n.strip()]
    if names in (["all"], ["all-linear"]):  # PEFT's "all-linear": every linear layer but the output head
        return ALL_TARGETS
    by_module = {path.rpartition(".")[2]: short for short, path in TARGETS.items()}
    by_path = {path: short for short, path in TARGETS.items()}
    picked = set()
    for name in names:
        short = name if name in TARGETS else by_module.get(name, by_path.get(name))
        if short is None:
            raise LoRAError(
                f"unknown LoRA target '{name}': choose from {','.join(ALL_TARGETS)} (or their HF names "
                f"{','.join(by_module)}, or all-linear)"
            )
        picked.add(short)
    if not picked:
        raise LoRAError(f"no LoRA targets given: name at least one of {','.join(ALL_TARGETS)}")
    return tuple(t for t in ALL_TARGETS if t in picked)


@dataclass
class LoRAConfig:
    """Adapter hyper-parameters (PEFT's ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``)."""

    rank: int = 8
    """r, the inner dimension of A (r, in) and B (out, r)."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / r (alpha / sqrt(r) with ``use_rslora``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training mode only); the base path sees x unchanged."""
    targets: tuple[str, ...] = ALL_TARGETS
    """Projections to adapt: any of q, k, v, o, gate, up, down (a comma-separated string is accepted)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""
    base_model_name_or_path: str | None = None
    """The base the adapters are trained on (a checkpoint directory, Hub id or preset; PEFT's field of that name):
    what saved adapter files name, so that the base can be loaded back under them."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise LoRAError(f"LoRA rank must be a positive integer, got {self.rank!r}: set --lora-rank to e.g. 8")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise LoRAError(f"LoRA alpha must be a positive number, got {self.alpha!r}: set --lora-alpha to e.g. 16")
        if not self.alpha <= torch.finfo(torch.float32).max:  # the scale s = alpha / r multiplies float32 outputs
            raise LoRAError(f"LoRA alpha {self.alpha:g} is past float32's range (3.4e38): set --lora-alpha to e.g. 16")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}: set --lora-dropout to e.g. 0.05")
        self.targets = parse_targets(self.targets)
        self.alpha = float(self.alpha)
        self.dropout = float(self.dropout)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _adapter_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision bases keep fp32 adapters (PEFT's autocast_adapter_dtype): tiny, and their updates stay exact.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update; shares the base's weight and bias Parameters."""

    def __init__(self, base: nn.Linear, config: LoRAConfig, generator: torch.Generator | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        factory = dict(device=base.weight.device, dtype=_adapter_dtype(base.weight.dtype))
        self.lora_A = nn.Linear(self.in_features, config.rank, bias=False, **factory)
        self.lora_B = nn.Linear(config.rank, self.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.config = config
        self.rank, self.scaling = config.rank, config.scaling
        self.enabled = True
        self.train(base.training)  # a model wrapped in eval mode stays in eval mode (no adapter dropout)
        self.reset_adapter(generator)

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A kaiming-uniform (a = sqrt 5) and B = 0: the adapter adds nothing until B is trained."""
        with torch.no_grad():
            a = self.lora_A.weight
            # Drawn on the CPU in fp32 so a seed gives the same A on every device and dtype.
            init = torch.empty(a.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
            a.copy_(init)
            self.lora_B.weight.zero_()

    def delta_weight(self) -> torch.Tensor:
        """s * B A (out, in), in the base weight's dtype: what :func:`merge` adds to W."""
        delta = self.lora_B.weight @ self.lora_A.weight * self.scaling
        return delta.to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled and self._fused_ok(x):
            a, b = self.lora_A.weight, self.lora_B.weight
            y = _LoRAProjection.apply(x.reshape(-1, self.in_features), self.weight, self.bias, a, b, self.scaling)
            return y.view(*x.shape[:-1], self.out_features)
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        if not self.enabled:
            return y
        h = x.to(self.lora_A.weight.dtype)
        if not torch.is_inference_mode_enabled():  # the engine samples (in inference mode) without dropout
            h = self.lora_dropout(h)
        return y + (self.lora_B(self.lora_A(h)) * self.scaling).to(y.dtype)

    def _fused_ok(self, x: torch.Tensor) -> bool:
        """Whether :class:`_LoRAProjection` computes this call: a frozen base, the adapter in the input's dtype, no
        dropout to apply, no autocast and no forward-mode AD (the general path below handles every other case)."""
        w, a = self.weight, self.lora_A.weight
        return (
            not w.requires_grad
            and (self.bias is None or not self.bias.requires_grad)
            and x.dtype == w.dtype == a.dtype
            and (isinstance(self.lora_dropout, nn.Identity) or not self.training or torch.is_inference_mode_enabled())
            and not torch.is_autocast_enabled(x.device.type)
            and torch._C._functorch.maybe_current_level() is None  # no torch.func transform (TRPO's jvp)
            and fwAD._current_level < 0  # nor forward-mode AD
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


class _LoRAProjection(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T for x (N, in) over a frozen W, b: the adapter's term accumulated into the base
    GEMM's output by the GEMM itself (``addmm_``, beta 1), and in the backward grad_x = g W + s (g B) A likewise, so
    no (N, out) or (N, in) element-wise pass is made (the general path scales and adds whole outputs and their
    gradients: on SmolLM2-135M's GRPO update a fifth of its CPU time). It keeps x and x A^T for the backward, as the
    general path's autograd does."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling):  # type: ignore[override]
        xa = x @ a.t()  # (N, r)
        y = F.linear(x, weight, bias)
        y.addmm_(xa, b.t(), alpha=scaling)
        ctx.save_for_backward(x, xa, weight, a, b)
        ctx.scaling = scaling
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, xa, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        gb = g @ b  # (N, r)
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).addmm_(gb, a, alpha=s)
        if ctx.needs_input_grad[3]:
            grad_a = torch.mm(gb.t(), x).mul_(s)
        if ctx.needs_input_grad[4]:
            grad_b = torch.mm(g.t(), xa).mul_(s)
        return grad_x, None, None, grad_a, grad_b, None


def _projection(block: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = path.rpartition(".")
    return getattr(block, parent_name), attr


def apply_lora(model: nn.Module, config: LoRAConfig, seed: int | None = None) -> dict[str, LoRALinear]:
    """Wrap ``config.targets`` in every block of ``model.layers`` with :class:`LoRALinear`, in place, and freeze
    everything but the adapters. Returns the wrapped layers by name (``layers.0.self_attn.q_proj``).

    A rank larger than a layer's smaller dimension (where the update would be full rank, not low rank) or a model
    already carrying adapters is a :class:`LoRAError`, raised before anything is changed."""
    if lora_layers(model):
        raise LoRAError("the model already has LoRA adapters: merge them (or load the base again) before adding more")
    planned: list[tuple[str, nn.Module, str, nn.Linear]] = []
    for idx, block in enumerate(model.layers):
        for target in config.targets:
            parent, attr = _projection(block, TARGETS[target])
            base = getattr(parent, attr)
            name = f"layers.{idx}.{TARGETS[target]}"
            if type(base) is not nn.Linear:
                raise LoRAError(
                    f"{name} is a {type(base).__name__}, not a plain nn.Linear: apply LoRA before "
                    "tensor parallelism or other layer swaps"
                )
            if config.rank > min(base.in_features, base.out_features):
                raise LoRAError(
                    f"LoRA rank {config.rank} exceeds {name}'s dimensions ({base.in_features} -> "
                    f"{base.out_features}): use a rank of at most {min(base.in_features, base.out_features)}"
                )
            planned.append((name, parent, attr, base))
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    wrapped = {}
    for name, parent, attr, base in planned:
        layer = LoRALinear(base, config, gen)
        setattr(parent, attr, layer)
        wrapped[name] = layer
    return wrapped


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's adapted projections by module name (empty for a plain model)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters by name (``layers.0.self_attn.q_proj.lora_A.weight``): what is trained and saved."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model: inside the block every adapter is off (outputs equal the base's exactly), afterwards each
    is as it was. This is the reference policy of DPO and of RL with a KL penalty. Tensor-parallel LoRA layers
    (``spinwheel.parallel.tensor_lora``, which keep the adapter's ``lora_A`` and ``enabled``) are switched too."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear) or hasattr(m, "lora_A") and hasattr(m, "enabled")]
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += s B A) and put plain ``nn.Linear`` layers back, in place.

    Afterwards the model is an ordinary :class:`Transformer` (``save_pretrained`` writes a plain HF checkpoint). An
    adapter switched off by :func:`adapters_disabled` is folded all the same; the base parameters keep their
    ``requires_grad`` (frozen, as :func:`apply_lora` left them)."""
    for name, layer in lora_layers(model).items():
        parent_name, _, attr = name.rpartition(".")
        layer.weight.add_(layer.delta_weight())
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        plain.weight, plain.bias = layer.weight, layer.bias
        setattr(model.get_submodule(parent_name), attr, plain)
    return model
