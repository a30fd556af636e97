"""LoRA adapters: the adapted forward against the merged model, the switch to the base, what trains and what the
optimizer holds, PEFT's file format (against ``peft`` itself where installed) and the one-line errors."""

import copy
import json

import pytest
import torch

from spinwheel.models import Transformer, save_pretrained
from spinwheel.models.lora import (
    ALL_TARGETS,
    LoRAConfig,
    LoRAError,
    adapters_disabled,
    apply_lora,
    lora_layers,
    lora_parameters,
    merge,
)
from spinwheel.models.lora_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter, save_adapter
from spinwheel.models.presets import preset_config
from spinwheel.train.optim import build_adamw

VOCAB = 100


def base_model(seed: int = 0, **overrides) -> Transformer:
    return Transformer(preset_config("test", VOCAB, **overrides)).init_weights(seed, std=0.1).eval()


def trained_adapter(model: Transformer, config: LoRAConfig, seed: int = 1) -> Transformer:
    """``model`` with adapters whose B is non-zero (as after training), so the adapters change the logits."""
    apply_lora(model, config, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)
    return model


def ids(batch: int = 2, tokens: int = 12) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(7))


def test_fresh_adapter_leaves_logits_unchanged():
    model = base_model()
    x = ids()
    with torch.no_grad():
        before = model(x)
        layers = apply_lora(model, LoRAConfig(rank=4, alpha=8))
        after = model(x)
    assert len(layers) == 2 * len(ALL_TARGETS)
    assert all(not m.lora_B.weight.any() and m.lora_A.weight.abs().min() > 0 for m in layers.values())
    assert torch.equal(before, after)


@pytest.mark.parametrize(
    "targets,rslora", [("q,k,v,o,gate,up,down", False), ("q_proj,v_proj", False), ("o,down", True)]
)
def test_lora_forward_equals_merged_model(targets, rslora):
    model = trained_adapter(base_model(), LoRAConfig(rank=4, alpha=12, dropout=0.1, targets=targets, use_rslora=rslora))
    x = ids()
    with torch.no_grad():
        adapted = model(x)  # eval mode: dropout is off
        merged = merge(copy.deepcopy(model))
        assert not lora_layers(merged) and all(type(m) is torch.nn.Linear for m in merged.layers[0].mlp.children())
        reference = merged(x)
        base = base_model()(x)
    assert (adapted - base).abs().max() > 1e-2  # the adapters matter ...
    torch.testing.assert_close(adapted, reference, atol=1e-5, rtol=0)  # ... and fold into the weights exactly


def test_disabled_adapters_give_the_base_logits_exactly():
    model = trained_adapter(base_model(), LoRAConfig(rank=4))
    x = ids()
    with torch.no_grad():
        base = base_model()(x)
        adapted = model(x)
        with adapters_disabled(model) as reference:
            off = reference(x)
        again = model(x)
    assert torch.equal(off, base)
    assert torch.equal(again, adapted) and not torch.equal(adapted, base)


def test_only_adapters_train_and_the_optimizer_holds_only_them():
    model = trained_adapter(base_model().train(), LoRAConfig(rank=4, dropout=0.1))
    x = ids()
    model(x).logsumexp(-1).mean().backward()
    adapters = lora_parameters(model)
    assert adapters and all(p.grad is not None and p.grad.abs().max() > 0 for p in adapters.values())
    frozen = [n for n, p in model.named_parameters() if n not in adapters]
    assert frozen and all(not p.requires_grad and p.grad is None for n, p in model.named_parameters() if n in frozen)
    opt = build_adamw(model, lr=1e-3, weight_decay=0.0)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in adapters.values()}


def adamw_state_bytes(model: Transformer) -> int:
    """Bytes of AdamW's state (exp_avg, exp_avg_sq, step) once it has stepped over the trainable parameters."""
    opt = build_adamw(model, lr=1e-3, weight_decay=0.0)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def test_optimizer_state_of_lora_r8_on_the_small_preset():
    """The issue's figure: AdamW state for LoRA r = 8 against full fine-tuning on the ``small`` preset."""
    full = adamw_state_bytes(Transformer(preset_config("small", VOCAB)))
    ratios = {}
    for targets in ("q,k,v,o,gate,up,down", "q,k,v,o"):
        model = Transformer(preset_config("small", VOCAB))
        apply_lora(model, LoRAConfig(rank=8, targets=targets))
        lora = adamw_state_bytes(model)
        adapters = sum(p.numel() for p in lora_parameters(model).values())
        assert lora <= 2 * 4 * adapters + 4 * 2 * len(lora_parameters(model))  # fp32 moments (+ fp32 step counts)
        ratios[targets] = lora / full
    print(f"optimizer state, small preset, LoRA r=8 / full: {ratios} (full {full / 2**20:.1f} MiB)")
    # Every projection of a 256-wide model at r = 8 is 5.04% of its parameters (r / width is 3%: the MLP's and
    # attention's factors add up); the attention projections alone are under 2%.
    assert ratios["q,k,v,o"] <= 0.02
    assert ratios["q,k,v,o,gate,up,down"] <= 0.051


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: LoRAConfig(rank=0), "LoRA rank must be a positive integer"),
        (lambda: LoRAConfig(rank=-2), "LoRA rank must be a positive integer"),
        (lambda: LoRAConfig(alpha=0), "LoRA alpha must be a positive number"),
        (lambda: LoRAConfig(dropout=1.0), "LoRA dropout must be in [0, 1)"),
        (lambda: LoRAConfig(targets="q,qq"), "unknown LoRA target 'qq'"),
        (lambda: LoRAConfig(targets="lm_head"), "unknown LoRA target 'lm_head'"),
        (lambda: LoRAConfig(targets=""), "no LoRA targets given"),
        # test preset: k_proj is 32 -> 16 (2 KV heads of 8)
        (lambda: apply_lora(base_model(), LoRAConfig(rank=17)), "exceeds layers.0.self_attn.k_proj's dimensions"),
        (lambda: apply_lora(trained_adapter(base_model(), LoRAConfig()), LoRAConfig()), "already has LoRA adapters"),
    ],
)
def test_bad_settings_fail_in_one_line(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert isinstance(info.value, LoRAError) and message in str(info.value) and "\n" not in str(info.value)


def test_a_rank_too_large_changes_nothing():
    model = base_model()
    with pytest.raises(LoRAError):
        apply_lora(model, LoRAConfig(rank=17, targets="q,k"))
    assert not lora_layers(model) and all(p.requires_grad for p in model.parameters())


def test_adapter_files_round_trip_in_peft_format(tmp_path):
    model = trained_adapter(base_model(), LoRAConfig(rank=4, alpha=8, dropout=0.05, targets="q,v,down"))
    save_adapter(model, tmp_path, base_model_name_or_path="test")
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.05)
    assert config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    assert config["base_model_name_or_path"] == "test" and config["fan_in_fan_out"] is False
    from safetensors import safe_open

    with safe_open(str(tmp_path / ADAPTER_WEIGHTS), framework="pt") as sf:
        keys = set(sf.keys())
    assert len(keys) == 2 * 3 * 2
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in keys
    loaded = base_model()
    assert load_adapter(loaded, tmp_path).targets == ("q", "v", "down")
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def strip_metadata(path) -> None:
    """Re-write the adapter's tensors without spinwheel's base-config metadata, as ``peft`` writes them."""
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(path / ADAPTER_WEIGHTS)), str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "other,peft_written,message",
    [
        (dict(intermediate_size=48), False, "the adapter's base has intermediate_size 64, the model 48"),
        (
            dict(intermediate_size=48),
            True,
            "layers.0.mlp.gate_proj.lora_B.weight' has shape (64, 4), the model needs (48, 4)",
        ),
        (dict(num_hidden_layers=3), False, "the adapter's base has num_hidden_layers 2, the model 3"),
        (dict(num_hidden_layers=3), True, "no tensor 'base_model.model.model.layers.2.self_attn.q_proj.lora_A"),
        (
            dict(num_hidden_layers=1),
            True,
            "tensor 'base_model.model.model.layers.1.mlp.down_proj.lora_A.weight' has no",
        ),
        # Same tensor shapes, other heads: only the base config tells them apart.
        (dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16), False, "base has num_attention_heads 4"),
    ],
)
def test_an_adapter_for_another_base_is_refused(tmp_path, other, peft_written, message):
    save_adapter(trained_adapter(base_model(), LoRAConfig(rank=4)), tmp_path, base_model_name_or_path="base-dir")
    if peft_written:
        strip_metadata(tmp_path)
    model = base_model(**other)
    with pytest.raises(LoRAError) as info:
        load_adapter(model, tmp_path)
    text = str(info.value)
    assert message in text and "load the base it was trained on (base-dir)" in text and "\n" not in text
    assert not lora_layers(model)  # checked before anything changed


@pytest.mark.parametrize(
    "change,message",
    [
        ({"use_dora": True}, "use_dora is set (DoRA)"),
        ({"bias": "all"}, "bias is 'all'; spinwheel supports bias 'none' only"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is set"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is set (per-layer ranks"),
        ({"layers_to_transform": [0]}, "layers_to_transform is set"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out is set"),
        ({"peft_type": "IA3"}, "peft_type is 'IA3'; spinwheel loads LoRA adapters only"),
        ({"task_type": "SEQ_CLS"}, "task_type is 'SEQ_CLS'"),
        ({"target_modules": ".*proj"}, "target_modules is the regular expression '.*proj'"),
        ({"target_modules": ["q_proj", "lm_head"]}, "unknown LoRA target 'lm_head'"),
        ({"r": 0}, "LoRA rank must be a positive integer"),
    ],
)
def test_unsupported_peft_options_are_refused(tmp_path, change, message):
    save_adapter(trained_adapter(base_model(), LoRAConfig(rank=4)), tmp_path, base_model_name_or_path="test")
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
    with pytest.raises(LoRAError) as info:
        load_adapter(base_model(), tmp_path)
    assert message in str(info.value) and ADAPTER_CONFIG in str(info.value) and "\n" not in str(info.value)


def test_peft_loads_spinwheel_adapters_and_spinwheel_loads_peft_adapters(tmp_path):
    """Both directions against ``peft`` on transformers' Llama: the same logits to 1e-5."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]' brings it)")
    import transformers

    model = base_model(seed=3)
    save_pretrained(model, tmp_path / "base")  # the plain base, before any adapter is applied
    trained_adapter(model, LoRAConfig(rank=4, alpha=8, targets="q,k,v,o,gate,up,down"))
    save_adapter(model, tmp_path / "ours", base_model_name_or_path=str(tmp_path / "base"))
    x = ids()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        ours = model(x)
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "ours").eval()(x).logits
    assert (ours - base_model(seed=3)(x)).abs().max() > 1e-2
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)

    # peft's own adapter (random B, rsLoRA, a subset of targets), read by spinwheel.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    lora = peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=["v_proj", "up_proj"], use_rslora=True, init_lora_weights=False
    )
    theirs_model = peft.get_peft_model(hf, lora).eval()
    theirs_model.save_pretrained(tmp_path / "theirs")
    spun = base_model(seed=3)
    assert load_adapter(spun, tmp_path / "theirs").targets == ("v", "up")
    with torch.no_grad():
        assert (spun(x) - base_model(seed=3)(x)).abs().max() > 1e-2
        torch.testing.assert_close(spun(x), theirs_model(x).logits, atol=1e-5, rtol=0)
