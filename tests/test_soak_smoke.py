"""``benchmarks/soak.py`` for a few seconds in one preemption mode, so that the script cannot rot: it must start the
server, run every kind of client (the poisoned one too) and the engine kill, and pass its own checks (the full soak
is a manual run)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_soak_script_runs_every_client_and_passes_its_checks():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "0.1", "--modes", "swap"]
    cmd += ["--clients", "3", "--min-preemptions", "0"]  # a few seconds need not preempt on a loaded machine
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    out = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, out
    by_status = ast.literal_eval(re.search(r"requests by status: (\{.*?\})", out).group(1))
    assert (
        by_status.get("2xx", 0) > 0
        and by_status.get("4xx", 0) > 0
        and by_status.get("unread stream", 0) + by_status.get("closed", 0) > 0
    ), out
    assert re.search(r"unexpected failures: 0 \(0 of normal clients\); catch-all 500s: 0", out), out
    poisoned = ast.literal_eval(re.search(r"poisoned requests: (\{.*?\})", out).group(1))
    assert any(k.endswith(": 400") for k in poisoned), out  # a wrong answer is an unexpected failure above
    assert re.search(r"KV blocks in use after draining: 0 of 48", out), out
    assert "ok   the engine came back after the kill" in out and "FAIL" not in out, out
