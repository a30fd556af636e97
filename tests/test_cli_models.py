"""Checkpoints in the ecosystem: a spinwheel checkpoint stops at ``<eos>`` in ``transformers``' ``generate`` (the
special-token ids in ``config.json`` and a ``generation_config.json``), and ``--model owner/name`` reads a Hugging
Face Hub model from the local HF cache without the network, or says in one line how to get it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import spinwheel
from spinwheel.models.presets import preset_config
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.train.checkpoint import save_checkpoint

CHAIN = "123"  # the model below continues 1 -> 2 -> 3 -> <eos> -> 9 -> 9 ...


def chain_model(tok: Tokenizer) -> Transformer:
    """A model whose next token depends only on the current one: attention and MLP outputs are zeroed, so the
    final hidden state is RMSNorm(embedding of the current token) and each lm_head row ``f(i)`` is that state for
    token ``i``: greedy decoding follows ``f``. After EOS comes more text, so only a stop at EOS ends early."""
    model = Transformer(preset_config("test", tok.vocab_size, tie_word_embeddings=False)).init_weights(0)
    ids = {c: tok.encode(c, add_special_tokens=False)[0] for c in "1239"}
    follow = {ids["1"]: ids["2"], ids["2"]: ids["3"], ids["3"]: tok.eos_id, tok.eos_id: ids["9"], ids["9"]: ids["9"]}
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for cur, nxt in follow.items():
            h = model.embed_tokens.weight[cur]
            model.lm_head.weight[nxt] = h / h.pow(2).mean().sqrt()  # the final norm's output for ``cur``
    return model


def test_hf_generate_stops_at_eos(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.char_level()
    model = chain_model(tok)
    prompt = tok.encode("1")  # <bos> 1
    ours = spinwheel.models.generate.generate(model, [prompt], 6, eos_id=None, pad_id=0)[0]
    assert tok.decode(ours, skip_special_tokens=False) == "23<eos>999"  # without a stop it runs on
    ckpt = save_checkpoint(tmp_path / "checkpoint", model, tok)
    config = json.loads((ckpt / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tok.bos_id,
        tok.eos_id,
        tok.pad_id,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert hf_tok.decode(out[0]) == "<bos>123<eos>"  # stopped at EOS: nothing after it
    assert hf.generation_config.eos_token_id == tok.eos_id


@pytest.mark.slow
def test_hub_id_through_the_local_cache(tmp_path):
    """``owner/name`` in a Hugging Face cache (the layout ``hf download`` writes) loads with the network
    unreachable; one that is not cached is a one-line error naming the fix."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--spinwheel-test--chain" / "snapshots" / ("a" * 40)
    tok = Tokenizer.char_level()
    save_checkpoint(snapshot, chain_model(tok), tok)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)

    def generate(model: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "spinwheel",
                "generate",
                "--model",
                model,
                "--prompt",
                "1",
                "--max-tokens",
                "6",
                "--device",
                "cpu",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    proc = generate("spinwheel-test/chain")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["prompt: 1", "output: 23"]  # the engine stops at EOS too
    proc = generate("spinwheel-test/missing")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "not in the local Hugging Face cache" in lines[0] and "the Hub is unreachable" in lines[0]
    assert "hf download spinwheel-test/missing" in lines[0]
