"""Bad command lines end in one line naming the command, the cause and what to do (in process: no subprocess)."""

from __future__ import annotations

import os
import socket

import pytest

import spinwheel
from spinwheel.cli import main
from spinwheel.models import ModelConfig, Transformer
from spinwheel.parallel.launch import launch


def _fail(capsys, argv: list[str]) -> list[str]:
    """Run ``spinwheel argv``; assert exit status 2; return the lines it printed (stdout and stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    out = capsys.readouterr()
    return (out.out + out.err).splitlines()


def test_unknown_option_is_one_line_of_its_command_with_a_close_match(capsys):
    (line,) = _fail(capsys, ["sft", "--stps", "4"])
    assert line.startswith("spinwheel sft: error: unrecognized arguments: --stps 4 (--stps: did you mean --steps?)")
    (line,) = _fail(capsys, ["generate", "--steps", "3"])  # another command's option: no far-fetched guess
    help_hint = "('spinwheel generate --help' lists the options)"
    assert line == f"spinwheel generate: error: unrecognized arguments: --steps 3 {help_hint}"


def test_argparse_errors_are_one_line_without_the_usage_block(capsys, monkeypatch):
    (line,) = _fail(capsys, ["dpo", "--loss-type", "foo"])
    assert line.startswith("spinwheel dpo: error: argument --loss-type: invalid choice: 'foo'")
    monkeypatch.setenv("RANK", "1")  # under torchrun rank 0 speaks for all
    assert _fail(capsys, ["dpo", "--loss-type", "foo"]) == []


def test_a_reward_model_is_refused_where_a_policy_is_needed(capsys, tmp_path):
    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1)  # fmt: skip
    spinwheel.save_pretrained(Transformer(cfg).init_weights(0), tmp_path / "rm")
    for argv in (["generate"], ["grpo", "--out-dir", str(tmp_path / "run")]):
        (line,) = _fail(capsys, [*argv, "--model", str(tmp_path / "rm")])
        assert f"error: --model {tmp_path / 'rm'} is a reward model" in line
    assert "--reward-model" in line and not (tmp_path / "run").exists()  # refused before the run starts


def test_a_prompt_past_the_context_is_named_briefly(capsys):
    (line,) = _fail(capsys, ["generate", "--model", "tiny", "--device", "cpu", "--prompt", "1" * 5000])
    assert "'1111111111111111111111111111111111111111'... (5000 characters)" in line and len(line) < 300


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--nproc-per-node", "0", "sft"], "--nproc-per-node 0: expected a number >= 1"),
        (["--nproc-per-node", "abc", "sft"], "--nproc-per-node abc: expected a number >= 1"),
        (["--nproc-per-node", "1", "launch", "sft"], "launch inside launch"),
        (["--nnodes", "2:1", "--nproc-per-node", "1", "sft"], "torchrun's options: min_nodes must be > 0"),
    ],
)
def test_launch_refuses_bad_options_in_one_line(capsys, argv, why):
    assert launch(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"spinwheel launch: error: {why}")


def test_serve_refuses_a_busy_port_before_loading_anything():
    from spinwheel.server.serve import ServeConfig, serve

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port} .*choose another --port"):
            serve(ServeConfig(model="/no/such/checkpoint", port=port))  # the port is named, not the checkpoint


def test_the_engine_process_leaves_the_servers_process_group():
    """A signal to the group (Ctrl-C, `timeout`, `kill -TERM -PGID`) reaches the server alone, which stops its engine
    in order; the engine got it too before, died, and the shutting-down server logged an error and restarted it."""
    from helpers import engine_spec

    from spinwheel.server.engine_client import EngineProcess

    ep = EngineProcess(engine_spec())
    try:
        assert os.getpgid(ep.pid) == ep.pid != os.getpgrp()
    finally:
        ep.shutdown()


def test_help_shows_a_config_summary_whole(capsys):
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's wrapping
    assert "write a plain HF checkpoint (config.json, safetensors, tokenizer). --model" in text  # not cut at a line


def test_a_directory_where_a_file_is_wanted_is_named_with_its_option(capsys, tmp_path):
    (line,) = _fail(capsys, ["envs", "expert", "--env", "calculator", "--num", "2", "--out", str(tmp_path)])
    assert line == f"spinwheel envs: error: --out {tmp_path} is a directory: give the path of the JSONL file to write"
    (line,) = _fail(capsys, ["classic", "--eval", str(tmp_path / "nope.pt")])
    assert line.startswith(f"spinwheel classic: error: --eval {tmp_path / 'nope.pt'} does not exist: give a policy.pt")


def test_an_allocation_the_machine_refuses_is_one_line(capsys, monkeypatch):
    import spinwheel.cli

    def refuse(ns):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
            "to allocate 4096000000000 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(spinwheel.cli, "_dispatch", refuse)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["generate", "--engine-num-kv-blocks", "1000000000"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("spinwheel generate: error: out of memory (3814.7 GiB asked for): the allocator refused;")


def test_stdout_into_a_closed_pipe_stops_quietly(capsys, monkeypatch):
    """`spinwheel envs list | head -1`: the reader has gone; no 'error: [Errno 32] Broken pipe' line."""
    import io
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", buffering=1) as broken:
        monkeypatch.setattr(sys, "stdout", broken)
        code = main(["envs", "list"])
        monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert code == 141
    assert capsys.readouterr().err == ""


def test_a_file_or_a_missing_directory_as_model_says_which(capsys, tmp_path):
    (tmp_path / "weights.bin").write_text("")
    (line,) = _fail(capsys, ["generate", "--model", str(tmp_path / "weights.bin")])
    assert f"{tmp_path / 'weights.bin'}: is a file, not a checkpoint directory" in line
    (line,) = _fail(capsys, ["merge", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert line.startswith(f"spinwheel merge: error: --model {tmp_path / 'nope'}: no such directory; give a LoRA")


def test_a_reward_model_with_no_held_out_pair_is_not_evaluated(capsys, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    out = tmp_path / "rm"
    assert (
        main(["rm", "--model", "tiny", "--data", str(data), "--steps", "1", "--no-progress", "--out-dir", str(out)])
        == 0
    )
    assert "held-out: not evaluated" in capsys.readouterr().out
    assert "NaN" not in (out / "metrics.jsonl").read_text()  # was eval_accuracy NaN, eval_margin NaN


def test_launch_help_describes_the_command_not_a_script(capsys):
    with pytest.raises(SystemExit):
        launch(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "COMMAND the spinwheel command each process runs" in text and "training program/script" not in text


def test_a_second_demo_on_a_running_demos_directory_is_refused(capsys, tmp_path):
    from spinwheel.demo import MARKER
    from spinwheel.train.run_dir import RunDirLock

    out = tmp_path / "demo"
    (out / "sft").mkdir(parents=True)
    (out / MARKER).write_text("{}\n")
    (out / "sft" / "metrics.jsonl").write_text("{}\n")  # the running demo's
    tiny = ["--sft-steps", "1", "--grpo-steps", "1", "--grpo-prompts", "1", "--eval-examples", "1", "--no-progress"]
    for agent in ([], ["--agent"]):
        with RunDirLock(out):  # a demo running there
            (line,) = _fail(capsys, ["demo", "--out-dir", str(out), *tiny, *agent])
        assert line.startswith(f"spinwheel demo: error: --out-dir {out} is in use by another run (pid {os.getpid()})")
    assert (out / "sft" / "metrics.jsonl").is_file()  # nothing of the running demo deleted


def test_serve_whose_engine_cannot_start_is_one_line_with_status_2(tmp_path, capsys):
    """The engine process failing at start-up on a bad checkpoint: one line, status 2 like other bad input."""
    spinwheel.save_pretrained(spinwheel.load_model("test"), tmp_path, tokenizer=spinwheel.Tokenizer.char_level())
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines = _fail(capsys, ["serve", "--model", str(tmp_path), "--port", str(port)])
    assert [line for line in lines if "error" in line] == [lines[-1]]
    assert lines[-1].startswith("spinwheel serve: error: the engine could not start: CheckpointError: ")
