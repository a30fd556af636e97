"""LoRA adapters on disk (issue 37, reliability items 2 and 4): an adapter with non-finite weights or a scale past
float32 is refused at load in one line (``serve --lora`` took it and answered empty text or NaN); an adapter trained
on a relative ``--model`` path loads from any directory (it named that relative path as its base)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_adapter, server_model
from safetensors.torch import load_file, save_file

import spinwheel
from spinwheel.engine import LLM
from spinwheel.models.hf import load_model, save_pretrained
from spinwheel.models.lora import LoRAConfig, LoRAError
from spinwheel.models.lora_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter, read_adapter_config
from spinwheel.server.serve import ServeConfig


def _adapter(tmp_path):
    base = server_model()
    path = tmp_path / "adapter"
    random_adapter(base, path, seed=1, targets="q,v", rank=4)
    return base, path


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_adapter_with_non_finite_weights_is_refused_at_load(tmp_path, value):
    base, path = _adapter(tmp_path)
    tensors = load_file(path / ADAPTER_WEIGHTS)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = value
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    llm = LLM(base, spinwheel.Tokenizer.char_level(), num_kv_blocks=16, block_size=4)
    with pytest.raises(LoRAError) as e:
        llm.add_lora("x", path)  # what `serve --lora x=DIR` does
    assert "non-finite" in str(e.value) and key in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(LoRAError, match="non-finite"):
        load_adapter(server_model(), path)


@pytest.mark.parametrize("alpha", [1e39, float("inf"), float("nan")])
def test_an_adapter_whose_scale_is_past_float32_is_refused(tmp_path, alpha):
    _, path = _adapter(tmp_path)
    raw = json.loads((path / ADAPTER_CONFIG).read_text())
    raw["lora_alpha"] = alpha
    (path / ADAPTER_CONFIG).write_text(json.dumps(raw))
    with pytest.raises(LoRAError) as e:
        read_adapter_config(path)
    assert "alpha" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="alpha"):
        ServeConfig(model="test", lora=[f"x={path}"]).loras()
    with pytest.raises(LoRAError):
        LoRAConfig(rank=4, alpha=4e38)  # --lora-alpha too


def test_an_adapter_trained_on_a_relative_base_loads_from_elsewhere(tmp_path, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    base = server_model()
    save_pretrained(base, work / "base")
    monkeypatch.chdir(work)
    merged = random_adapter(base, work / "runs" / "adapter", seed=2, targets="q,v", rank=4, base_name="base")
    stored = json.loads((work / "runs" / "adapter" / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    assert stored == str((work / "base").resolve())  # what --model named, made absolute
    monkeypatch.chdir(elsewhere)
    ids = torch.tensor([[1, 5, 9, 3]])
    loaded = load_model(str(work / "runs" / "adapter"))
    torch.testing.assert_close(loaded(ids), merged(ids), rtol=1e-5, atol=1e-5)


def test_a_named_model_or_hub_id_is_kept_as_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    random_adapter(server_model(), tmp_path / "a", seed=2, targets="q", rank=2, base_name="test")
    assert read_adapter_config(tmp_path / "a").base_model_name_or_path == "test"
    random_adapter(server_model(), tmp_path / "b", seed=2, targets="q", rank=2, base_name="HuggingFaceTB/SmolLM2-135M")
    assert read_adapter_config(tmp_path / "b").base_model_name_or_path == "HuggingFaceTB/SmolLM2-135M"


def test_an_old_adapter_naming_a_relative_base_beside_it_still_loads(tmp_path, monkeypatch):
    base = server_model()
    path = tmp_path / "adapter"
    merged = random_adapter(base, path, seed=3, targets="q", rank=2)
    save_pretrained(base, path / "base")
    raw = json.loads((path / ADAPTER_CONFIG).read_text())
    raw["base_model_name_or_path"] = "base"  # relative: as old adapters stored it
    (path / ADAPTER_CONFIG).write_text(json.dumps(raw))
    monkeypatch.chdir(tmp_path)
    ids = torch.tensor([[1, 5, 9, 3]])
    torch.testing.assert_close(load_model(str(path))(ids), merged(ids), rtol=1e-5, atol=1e-5)
