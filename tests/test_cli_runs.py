"""``spinwheel sft`` runs as a user reruns them: a finished run says so and appends nothing; a resumed run prints
what changed and refuses changes that would make it another run (unless --force); a one-line --data file trains
to the end; dropped examples are counted on the console; the header and the closing line; checkpoints readable
as the umask says."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli

from spinwheel.cli import main
from spinwheel.train.metrics import read_metrics

ARGS = [
    "--model",
    "test",
    "--steps",
    "6",
    "--batch-size",
    "4",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "1",
    "--eval-examples",
    "4",
    "--max-new-tokens",
    "3",
    "--task-num-digits",
    "1",
    "--task-num-train",
    "40",
    "--task-num-test",
    "4",
    "--no-progress",
    "--num-threads",
    "1",
]


def sft(capfd, out: Path, *extra: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """``spinwheel sft`` in this process (exit status, stdout, stderr as a subprocess's)."""
    return run_cli(["sft", *ARGS, "--out-dir", str(out), *extra], capfd, umask=umask)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_finished_run_says_so_and_appends_nothing(tmp_path, capfd):
    first = sft(capfd, tmp_path)
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "metrics.jsonl").read_bytes()
    again = sft(capfd, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "is at step 6 of 6: the run is finished" in again.stdout
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # no duplicate evaluation lines


@pytest.mark.slow
def test_resume_prints_what_changed_and_refuses_what_breaks_it(tmp_path, capfd):
    assert main(["sft", *ARGS, "--out-dir", str(tmp_path), "--stop-after", "2"]) == 0
    kept = (tmp_path / "metrics.jsonl").read_bytes()
    err = one_line_error(sft(capfd, tmp_path, "--lr", "1e-3", "--steps", "8"))
    assert "--steps 6 -> 8" in err and "--lr 0.003 -> 0.001" in err and "--force" in err
    assert "past --steps 1" in one_line_error(sft(capfd, tmp_path, "--steps", "1"))
    assert (tmp_path / "metrics.jsonl").read_bytes() == kept  # refused runs touch nothing
    capfd.readouterr()
    # Evaluation cadence changes nothing the run computes: taken, and said.
    assert main(["sft", *ARGS, "--out-dir", str(tmp_path), "--eval-every", "3"]) == 0
    out = capfd.readouterr().out
    assert "resuming from step 2 of 6 " in out and "changed: --eval-every 500 -> 3" in out
    assert main(["sft", *ARGS, "--out-dir", str(tmp_path / "full")]) == 0
    assert losses(tmp_path) == losses(tmp_path / "full")  # the resumed run is the uninterrupted one
    # --force takes the new schedule: the cosine over 8 steps from step 6 on.
    from spinwheel.train.optim import lr_at

    assert main(["sft", *ARGS, "--out-dir", str(tmp_path), "--steps", "8", "--force"]) == 0
    assert "--steps 6 -> 8" in capfd.readouterr().out
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl") if "lr" in r}
    assert lrs[7] == lr_at(6, 3e-3, 1, 8, 0.1) and lrs[6] == lr_at(5, 3e-3, 1, 6, 0.1)


@pytest.mark.slow
def test_one_line_data_trains_to_the_end_with_header_and_umask(tmp_path, capfd):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    out = tmp_path / "run"
    proc = sft(capfd, out, "--data", str(data), umask=0o027)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("spinwheel sft: test (") and "1 train / 0 held-out examples" in lines[0]
    assert "no held-out examples" in lines[-1] and f"wrote {out / 'checkpoint'}" in lines[-1]
    assert not any("eval_exact_match" in r for r in read_metrics(out / "metrics.jsonl"))
    ckpt = out / "checkpoint"
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o750
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ckpt.iterdir()}
    assert modes["model.safetensors"] == 0o640 and set(modes.values()) == {0o640}, modes


def test_dropped_examples_are_counted_on_the_console(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(6)]
    rows += [{"prompt": "9" * 40 + "=", "completion": "1"}, {"prompt": "8" * 50 + "=", "completion": "2"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(
            [
                "sft",
                *ARGS,
                "--data",
                str(data),
                "--max-seq-len",
                "20",
                "--steps",
                "2",
                "--out-dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    assert "dropped 2 examples longer than --max-seq-len 20" in capsys.readouterr().out
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["num_dropped"] == 2
