"""SFT with ``--lora-rank``: the adapters learn, the checkpoint is a PEFT adapter directory, resume is exact."""

import json

import pytest
import torch
from safetensors.torch import load_file

from spinwheel.models.hf import load_model
from spinwheel.models.lora import LoRAError, lora_layers, lora_parameters
from spinwheel.models.lora_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.train.metrics import read_metrics
from spinwheel.train.sft.sft import train_sft
from spinwheel.train.sft.sft_config import SFTConfig


def lora_sft_config(out_dir, **kw) -> SFTConfig:
    base = dict(
        model="test",
        out_dir=str(out_dir),
        steps=10,
        batch_size=8,
        lr=1e-2,
        warmup_steps=1,
        eval_every=0,
        eval_examples=4,
        max_new_tokens=4,
        save_every=5,
        progress=False,
        task=ArithmeticConfig(num_digits=1, num_train=60, num_test=10),
        lora_rank=4,
        lora_alpha=8,
    )
    return SFTConfig(**{**base, **kw})


def test_sft_with_lora_trains_the_adapters_and_writes_a_peft_adapter(tmp_path):
    result = train_sft(lora_sft_config(tmp_path / "full"))
    losses = result["losses"]
    # From a random base (loss ln 100 = 4.6) the adapters alone learn slowly: 4.56 -> 4.33 nats over the first and
    # last three steps; the bar is a 0.15-nat drop.
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.15
    ckpt = tmp_path / "full" / "checkpoint"
    names = {p.name for p in ckpt.iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json", "trainer_state.pt"} <= names
    assert "model.safetensors" not in names and "config.json" not in names  # the frozen base is not copied
    assert json.loads((ckpt / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == "test"
    first = read_metrics(tmp_path / "full" / "metrics.jsonl")[0]
    assert 0 < first["num_trainable_params"] < 0.2 * first["num_params"]

    # The adapters moved, the base did not: the adapted model is the preset base (seed 0) plus the adapters.
    base = load_model("test", seed=0)
    adapted = load_model(ckpt, seed=0, merge_adapter=False)
    assert all(p.abs().max() > 0 for n, p in lora_parameters(adapted).items() if "lora_B" in n)
    x = torch.randint(3, 100, (2, 9))
    with torch.no_grad():
        assert (adapted(x) - base(x)).abs().max() > 1e-3
        merged_weights = {k: v for k, v in adapted.state_dict().items() if "lora_" not in k}
        assert all(torch.equal(v, base.state_dict()[k]) for k, v in merged_weights.items())

    # Resume: an interrupted run continues from the adapters and their optimizer state to the same losses.
    part = train_sft(lora_sft_config(tmp_path / "split", stop_after=5))
    assert part["end_step"] == 5
    rest = train_sft(lora_sft_config(tmp_path / "split"))
    assert rest["start_step"] == 5 and part["losses"] + rest["losses"] == losses
    # (tensors, not bytes: safetensors orders the two metadata keys at random)
    saved = [load_file(str(tmp_path / d / "checkpoint" / ADAPTER_WEIGHTS)) for d in ("full", "split")]
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(v, saved[1][k]) for k, v in saved[0].items())
    assert len(lora_layers(adapted)) == 2 * 7


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(lora_rank=-1), "--lora-rank must be >= 0"),
        (dict(lora_targets="q,x"), "unknown LoRA target 'x'"),
        (dict(lora_dropout=1.5), "LoRA dropout must be in [0, 1)"),
    ],
)
def test_bad_lora_options_fail_in_one_line(tmp_path, kw, message):
    with pytest.raises(ValueError) as info:
        lora_sft_config(tmp_path, **kw)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_rank_larger_than_the_model_fails_before_training(tmp_path):
    with pytest.raises(LoRAError, match="exceeds layers.0.self_attn.k_proj's dimensions"):
        train_sft(lora_sft_config(tmp_path, lora_rank=20))
