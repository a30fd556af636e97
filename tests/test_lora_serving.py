"""LoRA adapters where a model is taken: ``spinwheel serve --lora NAME=DIR`` (the request's model field picks the
adapter, ``/v1/models`` lists them), ``--model ADAPTER_DIR`` (generate, the start of a run), ``spinwheel merge``
(a plain HF checkpoint with the logits of base + adapter); bad adapters fail in one line."""

import json

import httpx
import pytest
import torch
from helpers import random_adapter

import spinwheel
from spinwheel.cli import GenerateConfig, main, run_generate
from spinwheel.engine import LLM, EngineConfig, SamplingParams
from spinwheel.models.hf import load_model
from spinwheel.models.lora import LoRAError, adapters_disabled, lora_layers
from spinwheel.models.lora_io import ADAPTER_CONFIG
from spinwheel.server import BackgroundServer
from spinwheel.server.engine_process import EngineSpec
from spinwheel.server.serve import ServeConfig, build_server

PROMPTS = ["12+34=", "hello", "7*8="]
ENGINE = dict(num_kv_blocks=64, block_size=4, device="cpu")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Adapters 'a' (every projection) and 'b' (q, v) on the `test` preset as `--model test` loads it."""
    root = tmp_path_factory.mktemp("lora")
    base = load_model("test")
    merged = {
        "a": random_adapter(base, root / "a", 1, "all-linear", 4),
        "b": random_adapter(base, root / "b", 2, "q,v", 2),
    }
    return root, merged


def greedy(model, prompts=PROMPTS, max_tokens=8):
    outs = LLM(model, spinwheel.Tokenizer.char_level(), **ENGINE).generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    return [o.outputs[0].text for o in outs]


def test_serve_lists_the_adapters_and_routes_by_model_name(adapters):
    root, merged = adapters
    config = ServeConfig(model="test", lora=[f"a={root / 'a'}", str(root / "b")], engine_process=False, warmup=False)
    assert config.loras() == {"a": str(root / "a"), "b": str(root / "b")}
    with BackgroundServer(build_server(config, EngineConfig(**ENGINE))) as bs:
        models = httpx.get(bs.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["test", "a", "b"]
        assert [m.get("parent") for m in models] == [None, "test", "test"]
        for name, model in (("test", load_model("test")), ("a", merged["a"]), ("b", merged["b"])):
            body = {"model": name, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
            got = httpx.post(bs.url + "/v1/completions", json=body, timeout=60).json()
            assert [c["text"] for c in got["choices"]] == greedy(model), name
            assert got["model"] == name  # the response names the adapter it was served by, as vLLM's does
        chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        answer = httpx.post(bs.url + "/v1/chat/completions", json=chat, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == "b"
        r = httpx.post(bs.url + "/v1/completions", json={**body, "model": "c"}, timeout=60)
        assert r.status_code == 404
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("not_found_error", "model", "model_not_found")
        assert (
            error["message"] == "the model 'c' does not exist; this server serves 'test' and the LoRA adapters 'a', 'b'"
        )
    # the engine process builds its engine with the adapters too, and says which it serves
    assert EngineSpec("test", EngineConfig(**ENGINE), loras={"a": str(root / "a")}).build().loras.names == ["a"]


def test_serve_refuses_bad_adapters_at_start(adapters, tmp_path, capsys):
    root, _ = adapters
    with pytest.raises(ValueError, match="give NAME=DIR"):
        ServeConfig(model="test", lora=["a="])
    with pytest.raises(ValueError, match="the name 'a' is taken"):
        ServeConfig(model="test", lora=[f"a={root / 'a'}", f"a={root / 'b'}"])
    with pytest.raises(ValueError, match="the name 'test' is taken"):
        ServeConfig(model="test", lora=[f"test={root / 'a'}"])
    with pytest.raises(LoRAError, match="not a PEFT adapter directory"):
        ServeConfig(model="test", lora=[f"x={tmp_path}"])
    # an adapter trained on another base: one line at start, before anything is served
    random_adapter(load_model("tiny"), tmp_path / "other", 3, "q,v", 2, base_name="tiny")
    argv = ["serve", "--model", "test", "--lora", f"x={tmp_path / 'other'}", "--no-engine-process", "--no-warmup"]
    assert main(argv + ["--engine-num-kv-blocks", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the adapter's base has hidden_size 128, the model 32" in err


def test_generate_and_runs_take_an_adapter_directory_as_the_model(adapters, tmp_path, capsys):
    root, merged = adapters
    config = GenerateConfig(model=str(root / "a"), prompt=PROMPTS, max_tokens=8)
    assert [t[0] for t in run_generate(config, EngineConfig(**ENGINE))] == greedy(merged["a"])
    # --model ADAPTER_DIR loads the base folded with the adapter; merge_adapter=False keeps it as LoRA layers
    x = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        unmerged = load_model(root / "a", merge_adapter=False)
        assert len(lora_layers(unmerged)) == 2 * 7 and not lora_layers(load_model(root / "a"))
        torch.testing.assert_close(unmerged(x), merged["a"](x), rtol=0, atol=1e-5)
    # an adapter whose base cannot be found: one line naming the adapter and the base
    random_adapter(load_model("test"), tmp_path / "lost", 4, "q", 2, base_name="/nonexistent/base")
    assert main(["generate", "--model", str(tmp_path / "lost"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its base model '/nonexistent/base' (base_model_name_or_path) cannot be" in err


def test_merge_writes_a_plain_checkpoint_with_the_adapter_s_logits(adapters, tmp_path, capsys):
    import transformers

    root, _ = adapters
    out = tmp_path / "merged"
    assert main(["merge", "--model", str(root / "a"), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not (out / ADAPTER_CONFIG).exists()
    x = torch.randint(3, 100, (2, 9))
    with torch.no_grad():
        adapted = load_model(root / "a", merge_adapter=False)(x)  # base + adapter, unmerged
        torch.testing.assert_close(load_model(out)(x), adapted, rtol=0, atol=1e-5)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(hf(x).logits, adapted, rtol=0, atol=1e-5)
    assert main(["merge", "--model", str(root / "a"), "--out", str(out)]) == 2  # never over a checkpoint
    assert main(["merge", "--model", str(out), "--out", str(tmp_path / "again")]) == 2  # no adapter to merge
    assert "no adapter_config.json" in capsys.readouterr().err


def test_a_lora_run_from_an_adapter_trains_new_adapters_on_the_merged_model(adapters, tmp_path):
    from spinwheel.tasks.arithmetic import ArithmeticConfig
    from spinwheel.train.sft.sft import train_sft
    from spinwheel.train.sft.sft_config import SFTConfig

    root, merged = adapters
    config = SFTConfig(
        model=str(root / "a"),
        out_dir=str(tmp_path / "run"),
        steps=2,
        batch_size=4,
        eval_every=0,
        save_every=2,
        progress=False,
        task=ArithmeticConfig(num_digits=1, num_train=20, num_test=4),
        lora_rank=2,
    )
    train_sft(config)
    ckpt = tmp_path / "run" / "checkpoint"
    assert json.loads((ckpt / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(root / "a")
    model = load_model(ckpt, merge_adapter=False)  # down the chain: the base, 'a' folded in, the new adapters on it
    x = torch.randint(3, 100, (2, 7))
    with torch.no_grad(), adapters_disabled(model):
        torch.testing.assert_close(model(x), merged["a"](x), rtol=0, atol=1e-5)  # the run's reference: 'a' merged
