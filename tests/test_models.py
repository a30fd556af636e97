"""Model parity with HF transformers (logits to 1e-5 in fp32) and checkpoint round trips."""

import json

import pytest
import torch
import transformers  # the reference implementation (a test dependency)

import spinwheel
from spinwheel.models import CheckpointError, ConfigError, ModelConfig, Transformer, save_pretrained, token_logprobs

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "llama-gqa-untied-llama3rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=2, rope_scaling=LLAMA3_SCALING),
    ),
    "llama-mha-tied-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    ),
    "llama-linear-rope-theta": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=1, rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "qwen2-gqa-untied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "qwen2-mha-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3-gqa-headdim": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
}


def _hf_model(case: str):
    cfg_name, model_name, kwargs = CASES[case]
    config = getattr(transformers, cfg_name)(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        **kwargs,
    )
    torch.manual_seed(1)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0; randomise everything so all of it is tested
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = spinwheel.load_model(tmp_path / "hf")
    ids = torch.randint(0, 61, (3, 40))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    # Padded batch (left padding), as generation uses it: compare real positions only.
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[2, :3] = 0
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        out = ours(ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)

    # spinwheel-saved checkpoint loads back in transformers with the same logits.
    save_pretrained(ours, tmp_path / "ours")
    back = type(hf).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)


def test_rope_scaling_is_applied(tmp_path):
    """Guard against a parity test that passes because scaling is ignored on both sides."""
    hf = _hf_model("llama-gqa-untied-llama3rope")
    hf.save_pretrained(tmp_path)
    scaled = spinwheel.load_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plain = spinwheel.load_model(tmp_path)
    ids = torch.arange(60).remainder(61)[None]
    with torch.no_grad():
        assert (scaled(ids) - plain(ids)).abs().max() > 1e-3


def test_packed_sequences_equal_separate_forwards():
    model = spinwheel.load_model("test", vocab_size=50)
    a, b = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 5))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    seq_ids = torch.tensor([[0] * 7 + [1] * 5])
    with torch.no_grad():
        out = model(packed, positions=positions, seq_ids=seq_ids)
        torch.testing.assert_close(out[:, :7], model(a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[:, 7:], model(b), atol=1e-5, rtol=1e-5)


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, targets), ref)


def test_sharded_checkpoint_round_trip(tmp_path):
    model = spinwheel.load_model("test", vocab_size=50, seed=3)
    save_pretrained(model, tmp_path, shard_size_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = spinwheel.load_model(tmp_path)
    for (n, p), (n2, p2) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == n2
        torch.testing.assert_close(p, p2, rtol=0, atol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, back(ids), atol=1e-5, rtol=1e-5)


def test_load_dtype_and_presets():
    m = spinwheel.load_model("tiny", dtype="bfloat16")
    assert m.dtype == torch.bfloat16
    assert m.config.vocab_size == spinwheel.Tokenizer.char_level().vocab_size
    assert sum(p.numel() for p in set(m.parameters())) == m.config.num_params
    with pytest.raises(ValueError, match="unknown model preset|not found"):
        spinwheel.load_model("huge")


def test_num_params_matches_module_for_all_variants():
    for kw in (
        dict(),
        dict(attention_bias=True, mlp_bias=True),
        dict(qk_norm=True, model_type="qwen3"),
        dict(tie_word_embeddings=True),
        dict(attention_bias=True, model_type="qwen2"),
    ):
        cfg = ModelConfig(
            vocab_size=17,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **kw,
        )
        m = Transformer(cfg)
        assert cfg.num_params == sum(p.numel() for p in set(m.parameters()))


# ---- bad input: one-line errors naming the problem ----


def _saved(tmp_path):
    model = spinwheel.load_model("test", vocab_size=50)
    save_pretrained(model, tmp_path)
    return tmp_path


def test_truncated_checkpoint_file_is_one_error_naming_it(tmp_path):
    file = _saved(tmp_path) / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])  # an interrupted copy or download
    for lazy in (False, True):  # lazy: the learners' path under torchrun (parallel/io/lazy_load.py)
        with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file .*truncated"):
            spinwheel.load_model(tmp_path, lazy=lazy)


def test_missing_checkpoint_file(tmp_path):
    _saved(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        spinwheel.load_model(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        spinwheel.load_model(tmp_path / "nope")
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        spinwheel.load_model(tmp_path)


def test_unsupported_model_type(tmp_path):
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'") as e:
        spinwheel.load_model(tmp_path)
    assert "\n" not in str(e.value)


def test_missing_and_mismatched_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    _saved(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    bad = dict(tensors)
    bad.pop("model.layers.1.mlp.up_proj.weight")
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        spinwheel.load_model(tmp_path)
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.ones(7)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(7,\), expected \(32,\)"):
        spinwheel.load_model(tmp_path)
    bad = dict(tensors)
    bad["model.layers.9.extra.weight"] = torch.ones(2)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.9.extra.weight'"):
        spinwheel.load_model(tmp_path)


def test_bad_config_values(tmp_path):
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="'hidden_act' must be 'silu'"):
        ModelConfig(hidden_act="gelu")
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing required key 'hidden_size'"):
        spinwheel.load_model(tmp_path)


# ---- scalar (reward-model) head: HF's *ForSequenceClassification ----------------------------------------------------
def _right_padded(vocab: int, pad: int) -> torch.Tensor:
    """Rows of uneven length, right-padded with ``pad`` (real tokens drawn from 1..vocab-1, never the pad)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, vocab, (4, 12), generator=gen)
    for row, n in enumerate((12, 7, 3, 9)):
        ids[row, n:] = pad
    return ids


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_reward_model_scores_match_transformers(model_type, tmp_path):
    """Our saved RM loads as AutoModelForSequenceClassification and scores each row as our values at its last
    non-pad token; a HF-made classifier loads back into ours with the same scores."""
    config = ModelConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        model_type=model_type,
        attention_bias=model_type == "qwen2",
        pad_token_id=0,
        num_labels=1,
    )
    ours = Transformer(config).init_weights(seed=2, std=0.3)
    save_pretrained(ours, tmp_path / "rm")
    saved = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert saved["architectures"] == [f"{'Llama' if model_type == 'llama' else 'Qwen2'}ForSequenceClassification"]
    assert saved["id2label"] == {"0": "LABEL_0"}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "rm" / "model.safetensors"), framework="pt") as sf:
        assert "score.weight" in sf.keys() and "lm_head.weight" not in sf.keys()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert hf.config.num_labels == 1
    ids = _right_padded(61, pad=0)
    last = (ids != 0).sum(1) - 1
    with torch.no_grad():
        values = ours(ids)  # (B, T, 1)
        ref = hf(ids).logits  # (B, 1)
    assert values.shape == (4, 12, 1)
    torch.testing.assert_close(values[torch.arange(4), last], ref, atol=1e-5, rtol=1e-5)
    hf.save_pretrained(tmp_path / "hf")
    back = spinwheel.load_model(tmp_path / "hf")
    assert back.config.num_labels == 1 and back.lm_head.weight.shape == (1, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(ids)[torch.arange(4), last], ref, atol=1e-5, rtol=1e-5)


def test_scalar_head_model_copies_the_body():
    from spinwheel.models.transformer import scalar_head_model

    lm = spinwheel.load_model("test", vocab_size=50, seed=4)
    lm_config = json.dumps(lm.config.to_hf_dict(), sort_keys=True)
    rm = scalar_head_model(lm, seed=1)
    assert json.dumps(lm.config.to_hf_dict(), sort_keys=True) == lm_config  # the LM is untouched
    assert rm.config.num_labels == 1 and not rm.config.tie_word_embeddings
    assert rm.lm_head.weight.shape == (1, 32)
    assert rm.lm_head.weight.std().item() < 2 / 33**0.5
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(rm(ids, return_hidden=True), lm(ids, return_hidden=True), rtol=0, atol=0)
        torch.testing.assert_close(rm(ids), rm(ids, return_hidden=True) @ rm.lm_head.weight.T)
    assert sum(p.numel() for p in rm.parameters()) == rm.config.num_params
    tied = scalar_head_model(spinwheel.load_model("tiny"), seed=1)  # a tied LM: the RM's head is its own
    assert tied.lm_head.weight.data_ptr() != tied.embed_tokens.weight.data_ptr()


def test_bad_scalar_head_configs(tmp_path):
    with pytest.raises(ConfigError, match="'num_labels' must be 1"):
        ModelConfig(num_labels=3)
    with pytest.raises(ConfigError, match="cannot tie its score head"):
        ModelConfig(num_labels=1, tie_word_embeddings=True)
    hf_config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_labels=3,
        pad_token_id=0,
    )
    transformers.LlamaForSequenceClassification(hf_config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="config.json: config key 'num_labels' must be 1.*got 3"):
        spinwheel.load_model(tmp_path)
