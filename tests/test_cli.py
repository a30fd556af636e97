"""The spinwheel command: help documents every config field once, every command has a description, --version;
bad input (a CUDA device on a CPU build included) ends with a one-line error; generate's sampling options and
output; generate and serve spell their settings alike."""

import dataclasses
import json
import re

import pytest
import torch
from helpers import run_cli

import spinwheel
from spinwheel.cli import GenerateConfig, PlacementConfig, build_parser, main
from spinwheel.demo import DemoConfig
from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.train.sft.sft_config import SFTConfig


@pytest.mark.parametrize(
    "command,configs",
    [
        ("sft", [(SFTConfig, ""), (ArithmeticConfig, "task-")]),
        ("demo", [(DemoConfig, "")]),
        ("generate", [(GenerateConfig, ""), (PlacementConfig, "")]),
        ("serve", [(PlacementConfig, "")]),
    ],
)
def test_help_documents_every_field(command, configs, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    for cls, prefix in configs:
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                continue
            assert "--" + prefix + f.name.replace("_", "-") in text
            assert f.metadata["help"].split()[0] in text


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_malformed_jsonl_line(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "completion": 4}\n')
    assert (
        main(["sft", "--data", str(data), "--model", "test", "--out-dir", str(tmp_path / "run"), "--no-progress"]) == 2
    )
    err = _error_line(capsys)
    assert "train.jsonl:2" in err and "'completion'" in err


def test_missing_checkpoint_and_unsupported_model_type(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2
    assert "checkpoint directory not found" in _error_line(capsys)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    assert main(["generate", "--model", str(tmp_path)]) == 2
    assert "unsupported model_type 'bert'" in _error_line(capsys)


def test_bad_option_values(tmp_path, capsys):
    assert main(["sft", "--steps", "0", "--out-dir", str(tmp_path)]) == 2
    assert "--steps must be >= 1" in _error_line(capsys)
    assert main(["sft", "--task-operators", "/", "--out-dir", str(tmp_path)]) == 2
    assert "unknown operators" in _error_line(capsys)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert (
        main(
            [
                "sft",
                "--model",
                "test",
                "--out-dir",
                str(out),
                "--steps",
                "3",
                "--batch-size",
                "4",
                "--eval-examples",
                "4",
                "--max-new-tokens",
                "3",
                "--task-num-train",
                "50",
                "--task-num-test",
                "5",
                "--no-progress",
            ]
        )
        == 0
    )
    return out / "checkpoint"


def outputs(text: str) -> list[tuple[str, list[str]]]:
    """(prompt, completions) blocks of generate's output."""
    blocks = []
    for block in text.strip().split("\n\n"):
        lines = block.splitlines()
        assert lines[0].startswith("prompt: ")
        assert all(re.match(r"output( \d+)?: ", line) for line in lines[1:]), block
        blocks.append((lines[0][len("prompt: ") :], [line.split(": ", 1)[1] for line in lines[1:]]))
    return blocks


def test_sft_then_generate_end_to_end(checkpoint, capsys):
    capsys.readouterr()
    assert main(["generate", "--model", str(checkpoint), "--prompt", "1+2=", "3+4=", "--max-tokens", "3"]) == 0
    text = capsys.readouterr().out
    greedy = outputs(text)
    assert [p for p, _ in greedy] == ["1+2=", "3+4="] and all(len(c) == 1 for _, c in greedy)
    # engine options reach the engine: tiny blocks, the model's own forward, no prefix cache -> the same text
    assert (
        main(
            [
                "generate",
                "--model",
                str(checkpoint),
                "--prompt",
                "1+2=",
                "3+4=",
                "--max-tokens",
                "3",
                "--engine-block-size",
                "2",
                "--no-engine-cpu-packed-weights",
                "--no-engine-enable-prefix-caching",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == text
    assert main(["generate", "--model", str(checkpoint), "--engine-block-size", "0"]) == 2
    assert "--engine-block-size must be >= 1" in _error_line(capsys)


def test_generate_sampling_options(checkpoint, capsys):
    """--top-k 1 and a tiny --top-p keep only the most likely token, so sampling at temperature 1 is greedy;
    --n gives n completions; --stop cuts a completion before the stop string."""
    capsys.readouterr()
    base = ["generate", "--model", str(checkpoint), "--prompt", "1+2=", "--max-tokens", "6"]
    assert main(base) == 0
    greedy = outputs(capsys.readouterr().out)[0][1][0]
    for narrow in (["--top-k", "1"], ["--top-p", "1e-6"]):
        assert main(base + ["--temperature", "1", "--n", "3", *narrow]) == 0
        assert outputs(capsys.readouterr().out)[0][1] == [greedy] * 3
    assert main(base + ["--temperature", "1", "--n", "4", "--seed", "1"]) == 0
    assert len(outputs(capsys.readouterr().out)[0][1]) == 4
    stop = next(ch for ch in greedy[1:] if ch.strip())
    assert main(base + ["--stop", stop]) == 0
    assert outputs(capsys.readouterr().out)[0][1] == [greedy[: greedy.index(stop)]]
    assert main(base + ["--n", "0"]) == 2
    assert "--n" in _error_line(capsys)


def test_generate_chat_shows_the_message_not_the_template(checkpoint, capsys):
    capsys.readouterr()
    assert main(["generate", "--model", str(checkpoint), "--prompt", "hello", "--chat", "--max-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("prompt: hello\noutput: ") and "<bos>" not in text and "<|user|>" not in text


def test_generate_and_serve_spell_settings_alike():
    parser = build_parser()
    gen, srv = parser.parse_args(["generate"]), parser.parse_args(["serve"])
    for name in ("device", "dtype", "seed"):
        assert getattr(gen, name) == getattr(srv, name) == getattr(PlacementConfig(), name)
        assert not hasattr(gen, f"engine_{name}") and not hasattr(srv, f"engine_{name}")
    assert gen.model == srv.model == "runs/demo/grpo/checkpoint"


def test_version_and_descriptions(capfd):
    proc = run_cli(["--version"], capfd)
    assert proc.returncode == 0 and proc.stdout.strip() == f"spinwheel {spinwheel.__version__}"
    sub = next(a for a in build_parser()._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name, p in sub.choices.items():
        if name != "launch":
            assert p.description and len(p.description) > 20, name
    assert "launch" in sub.choices


@pytest.mark.parametrize("command", ["demo", "sft", "grpo", "generate", "serve", "classic"])
def test_help_shows_each_default_once(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert not re.search(r"\(default: [^)]*\)\s*\(default:", text)
    assert "(default: None)" not in text
    assert "the built-in arithmetic task (default:" not in text  # a help that states its default shows no other


def test_launch_help_is_torchruns(capfd):
    proc = run_cli(["launch", "--help"], capfd)
    assert proc.returncode == 0 and "spinwheel launch" in proc.stdout and "--nproc-per-node" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU build of torch")
def test_cuda_device_without_cuda_is_one_line(tmp_path, capfd):
    proc = run_cli(["sft", "--device", "cuda", "--out-dir", str(tmp_path)], capfd)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--device cuda: this PyTorch build has no CUDA" in proc.stderr
    for command in (["generate"], ["serve"], ["grpo", "--out-dir", str(tmp_path)]):
        assert main([*command, "--device", "cuda"]) == 2
        assert "no CUDA" in _error_line(capfd)
    assert main(["generate", "--device", "gpu"]) == 2
    assert "not a torch device" in _error_line(capfd)


def test_parser_defaults_build_valid_configs(capsys):
    ns = build_parser().parse_args(["demo"])
    assert ns.out_dir == "runs/demo" and ns.sft_steps == DemoConfig().sft_steps
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "'runs/demo'" in text and "runs/sft" not in text and "--resume" not in text  # the demo's own defaults


def test_demo_never_deletes_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo", "--out-dir", str(tmp_path), "--sft-steps", "1", "--grpo-steps", "1"]) == 2
    assert "not written by spinwheel demo" in _error_line(capsys)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_classic_command_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "cl"
    assert (
        main(
            [
                "classic",
                "--algo",
                "ppo",
                "--env",
                "CartPole-v1",
                "--steps",
                "1024",
                "--num-envs",
                "2",
                "--out-dir",
                str(out),
                "--eval-episodes",
                "2",
            ]
        )
        == 0
    )
    assert "evaluation: return" in capsys.readouterr().out
    assert {"metrics.jsonl", "learning_curve.png", "policy.pt"} <= {p.name for p in out.iterdir()}
    with pytest.raises(SystemExit):  # argparse rejects an unknown algorithm
        main(["classic", "--algo", "sac"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt", "hi", "--engine-max-num-seqs", "0"], "--engine-max-num-seqs must be >= 1, got 0"),
        (
            ["serve", "--engine-max-num-batched-tokens-with-decodes", "3"],
            "--engine-max-num-batched-tokens-with-decodes must be between --engine-max-num-seqs (256) and "
            "--engine-max-num-batched-tokens (2048), got 3",
        ),
    ],
)
def test_engine_option_errors_name_the_flag_not_the_field(argv, message, capsys):
    """The engine's own checks speak of its fields; on the command line the user typed the flags."""
    assert main([*argv, "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"spinwheel {argv[0]}: error: {message}"]
