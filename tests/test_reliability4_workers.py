"""A worker of a multi-process engine that dies while the engine starts is reported at once, in one line (issue 37,
reliability item 6): the driver watches the workers while it waits for them, instead of blocking in the process
group's rendezvous until its timeout (60 s). The commonest cause, a script without the ``__main__`` guard (each
worker imports the main script and starts an engine again), is named with its fix."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from spinwheel.engine.parallel.workers import TensorParallelError, WorkerProcesses

SCRIPT = """
from spinwheel.engine import LLM
from spinwheel.models import Transformer
from spinwheel.models.presets import preset_config

model = Transformer(preset_config("test", vocab_size=100)).init_weights(seed=0)
llm = LLM(model, tensor_parallel_size=2, num_kv_blocks=8, block_size=4)
print("generated", llm.generate([[5, 6, 7]])[0].outputs[0].token_ids)
"""


def test_an_engine_started_without_the_main_guard_fails_at_once_saying_how_to_fix_it(tmp_path):
    (tmp_path / "unguarded.py").write_text(SCRIPT)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "unguarded.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert done.returncode == 1 and "generated" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("spinwheel.engine.parallel.workers.TensorParallelError: tensor-parallel worker 1"), (
        done.stderr
    )
    assert "if __name__ == '__main__':" in last and "unguarded.py" in last
    assert done.stderr.count("Traceback") == 1, done.stderr  # the driver's alone: no chained one, none from the worker
    assert took < 30  # not the process group's 60 s timeout (a fresh interpreter and torch take a few seconds)

    guarded = "if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in SCRIPT.strip().splitlines())
    (tmp_path / "guarded.py").write_text(guarded)
    done = subprocess.run([sys.executable, "guarded.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "generated" in done.stdout, done.stderr


class _Workers(WorkerProcesses):
    kind = "test worker"

    def close(self, timeout_s: float = 5.0) -> None:
        self.stop_workers(None, timeout_s)


def failing_worker(rank, world, init_method, backend, timeout_s, conn) -> None:
    raise ValueError(f"no device cuda:{rank + 6} on this machine")


def exiting_worker(rank, world, init_method, backend, timeout_s, conn) -> None:
    import os

    os._exit(3)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (failing_worker, "test worker 1 failed: ValueError: no device cuda:7 on this machine"),
        (exiting_worker, "test worker 1 (pid"),
    ],
)
def test_a_worker_that_fails_before_joining_is_reported_within_two_seconds(target, message):
    workers = _Workers(2, timeout_s=60.0)
    workers.start(1, target, (1, 2, workers.init_method, "gloo", 60.0), "test-worker")
    start = time.monotonic()
    with pytest.raises(TensorParallelError) as e:
        workers.join("gloo")
    assert time.monotonic() - start < 2.0
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert workers.procs == []  # closed
