"""LoRALinear's fused path (the adapter's term accumulated into the base GEMM, forward and backward) against the
definition y = x W^T + b + s (x A^T) B^T and its autograd gradients, and when the general path is taken instead."""

import pytest
import torch
from torch import nn

from spinwheel.models.lora import LoRAConfig, LoRALinear


def _layer(bias: bool, dropout: float = 0.0, seed: int = 0) -> LoRALinear:
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(24, 40, bias=bias)
    base.weight.requires_grad_(False)
    if bias:
        base.bias.requires_grad_(False)
    layer = LoRALinear(base, LoRAConfig(rank=4, alpha=12, dropout=dropout), g)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.3)
    return layer


def _reference(layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    a, b = layer.lora_A.weight, layer.lora_B.weight
    y = x @ layer.weight.t() + layer.scaling * ((x @ a.t()) @ b.t())
    return y + layer.bias if layer.bias is not None else y


@pytest.mark.parametrize("bias", [False, True])
def test_fused_lora_forward_and_gradients_equal_the_definition(bias):
    layer = _layer(bias)
    x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert layer._fused_ok(x)
    upstream = torch.randn(3, 7, 40, generator=torch.Generator().manual_seed(2))
    y = layer(x)
    assert "LoRAProjection" in type(y.grad_fn.next_functions[0][0]).__name__  # the fused path ran (then a view)
    grads = torch.autograd.grad((y * upstream).sum(), (x, layer.lora_A.weight, layer.lora_B.weight))
    y_ref = _reference(layer, x)
    grads_ref = torch.autograd.grad((y_ref * upstream).sum(), (x, layer.lora_A.weight, layer.lora_B.weight))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_lora_without_input_gradient_and_under_no_grad():
    layer = _layer(True)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(3))  # the first layer's input needs no grad
    y = layer(x)
    y.sum().backward()
    a, b = layer.lora_A.weight.grad, layer.lora_B.weight.grad
    layer.zero_grad()
    _reference(layer, x).sum().backward()
    torch.testing.assert_close(a, layer.lora_A.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, layer.lora_B.weight.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-5)


def test_general_path_where_the_fused_one_does_not_apply():
    x = torch.randn(4, 24)
    dropped = _layer(False, dropout=0.5)
    assert dropped.training and not dropped._fused_ok(x)  # adapter dropout in training: the general path
    assert dropped.eval()._fused_ok(x)  # no dropout in eval mode
    trained_base = _layer(False)
    trained_base.weight.requires_grad_(True)  # a base that trains needs its own gradient: the general path
    assert not trained_base._fused_ok(x)
    assert not _layer(False)._fused_ok(x.double())
    off = _layer(True)
    off.enabled = False
    torch.testing.assert_close(off(x), nn.functional.linear(x, off.weight, off.bias))
