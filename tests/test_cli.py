"""The spinwheel command: help documents every config field; bad input ends with a one-line error."""

import dataclasses
import json

import pytest

from spinwheel.cli import GenerateConfig, build_parser, main
from spinwheel.demo import DemoConfig
from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.train.sft_config import SFTConfig


@pytest.mark.parametrize("command,configs", [("sft", [(SFTConfig, ""), (ArithmeticConfig, "task-")]),
                                             ("demo", [(DemoConfig, "")]),
                                             ("generate", [(GenerateConfig, "")])])
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
    assert main(["sft", "--data", str(data), "--model", "test", "--out-dir", str(tmp_path / "run"),
                 "--no-progress"]) == 2
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


def test_sft_then_generate_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["sft", "--model", "test", "--out-dir", str(out), "--steps", "3", "--batch-size", "4",
                 "--eval-examples", "4", "--max-new-tokens", "3", "--task-num-train", "50", "--task-num-test",
                 "5", "--no-progress"]) == 0
    assert "held-out exact match" in capsys.readouterr().out
    assert main(["generate", "--model", str(out / "checkpoint"), "--prompt", "1+2=", "3+4=",
                 "--max-tokens", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("1+2=") and lines[1].startswith("3+4=")
    # engine options reach the engine: tiny blocks, the model's own forward, no prefix cache -> the same text
    assert main(["generate", "--model", str(out / "checkpoint"), "--prompt", "1+2=", "3+4=", "--max-tokens", "3",
                 "--engine-block-size", "2", "--no-engine-cpu-packed-weights",
                 "--no-engine-enable-prefix-caching"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == lines
    assert main(["generate", "--model", str(out / "checkpoint"), "--engine-block-size", "0"]) == 2
    assert "block_size" in _error_line(capsys)


def test_parser_defaults_build_valid_configs():
    ns = build_parser().parse_args(["demo"])
    assert ns.out_dir == "runs/demo" and ns.sft_steps == DemoConfig().sft_steps


def test_demo_never_deletes_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo", "--out-dir", str(tmp_path), "--sft-steps", "1", "--grpo-steps", "1"]) == 2
    assert "not written by spinwheel demo" in _error_line(capsys)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_classic_command_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "cl"
    assert main(["classic", "--algo", "ppo", "--env", "CartPole-v1", "--steps", "1024", "--num-envs", "2",
                 "--out-dir", str(out), "--eval-episodes", "2"]) == 0
    assert "evaluation: return" in capsys.readouterr().out
    assert {"metrics.jsonl", "learning_curve.png", "policy.pt"} <= {p.name for p in out.iterdir()}
    with pytest.raises(SystemExit):  # argparse rejects an unknown algorithm
        main(["classic", "--algo", "sac"])
