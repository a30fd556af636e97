"""spinwheel.threads: torch's thread count fitted to the CPUs other processes leave free (no timing assertions)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

from spinwheel import threads


def test_free_cpus_take_out_our_own_time():
    # 2 CPUs busy for 1 s, 1 CPU-second of it ours: one CPU left free by the others
    assert threads.free_cpus(2.0, 1.0, 1.0, cpus=2, usable=2) == 1.0
    assert threads.free_cpus(0.1, 0.9, 1.0, cpus=2, usable=2) == 2.0  # tick rounding never counts us twice
    assert threads.free_cpus(0.0, 0.0, 1.0, cpus=8, usable=2) == 2.0  # only the CPUs our affinity allows
    assert threads.free_cpus(5.0, 0.0, 1.0, cpus=4, usable=4) == 0.0


@pytest.mark.parametrize(("free", "cap", "want"), [(2.0, 2, 2), (1.33, 2, 1), (1.6, 2, 2), (0.0, 2, 1), (7.9, 4, 4)])
def test_threads_for_rounds_within_one_and_the_cap(free, cap, want):
    assert threads.threads_for(free, cap) == want


@pytest.mark.parametrize(
    ("current", "cap", "free", "wait", "settled", "want"),
    [
        (2, 2, 1.3, 0.6, True, 1),  # we wait for our CPUs: one fewer
        (4, 4, 1.0, 0.6, False, 1),  # ... or as many as are free, if fewer
        (2, 2, 1.0, 0.05, True, 2),  # others use a CPU but yield it to us (lower priority): kept
        (1, 2, 2.0, 0.0, False, 1),  # free, but too soon after the last change (no flapping)
        (1, 2, 1.0, 0.0, True, 2),  # a probe
        (1, 4, 3.2, 0.0, True, 3),  # the CPUs measured free
        (1, 1, 2.0, 0.0, True, 1),  # never above the cap
    ],
)
def test_next_threads(current, cap, free, wait, settled, want):
    assert threads.next_threads(current, cap, free, wait, settled) == want


def test_waits_of_threads_present_in_both_samples():
    assert threads.waited_seconds({"1": 10**9, "2": 5}, {"1": 3 * 10**9, "3": 10**12}) == 2.0


FIT = textwrap.dedent(
    """
    import types
    import spinwheel.threads as th
    import torch

    torch.set_num_threads(2)
    clock, cpu = [0.0], [0.0, 0.0, 0]  # seconds; CPU seconds busy machine-wide and ours; our threads' wait (ns)
    th.time = types.SimpleNamespace(monotonic=lambda: clock[0])
    th.sample_cpu = lambda: (cpu[0], cpu[1], {"1": cpu[2]})
    th.usable_cpus = lambda: 2
    th._CPUS = 2

    def second(others, ours, wait, seconds=1.0):  # time passes: CPUs others and we use, CPUs' worth we wait
        clock[0] += seconds
        cpu[0] += (others + ours) * seconds
        cpu[1] += ours * seconds
        cpu[2] += int(wait * seconds * 1e9)
        return th.fit_threads(), torch.get_num_threads()

    print(th.fit_threads(), torch.get_num_threads())
    print(*second(0.0, 2.0, 0.0))  # quiet: as it was
    print(*second(0.9, 1.1, 0.02))  # others use a CPU, but do not make us wait (lower priority): as it was
    print(*second(0.67, 1.33, 0.67))  # a busy process takes turns with our threads: one fewer
    clock[0] += 0.5 * th.INTERVAL_S
    print(th.fit_threads(), torch.get_num_threads())  # between measurements: nothing sampled, nothing changed
    print(*second(0.05, 1.0, 0.0))  # it went away, but the count changed a moment ago
    print(*second(1.0, 1.0, 0.0, seconds=th.PROBE_S))  # PROBE_S later: one more tried
    print(*second(0.67, 1.33, 0.67))  # it still makes us wait: back
    print(*second(0.0, 1.0, 0.0, seconds=th.PROBE_S))  # it went away: the next probe stays
    torch.set_num_threads(1)  # the user's (or --num-threads) count is the cap from now on
    print(*second(0.0, 1.0, 0.0, seconds=th.PROBE_S))
    """
)


def run_python(code: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("SPINWHEEL_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.split("\n")[:-1]


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat (Linux)")
def test_fit_threads_follows_the_free_cpus_in_a_fresh_process():
    assert run_python(FIT) == ["2 2", "2 2", "2 2", "1 1", "1 1", "1 1", "2 2", "1 1", "2 2", "1 1"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat (Linux)")
def test_on_by_default_and_off_with_the_environment_variable():
    code = "import spinwheel, spinwheel.threads as th, torch; print(th.enabled(), th.fit_threads() is None)"
    assert run_python(code) == ["True False"]
    assert run_python(code, SPINWHEEL_THREADS="off") == ["False True"]


def test_an_unknown_setting_is_warned_about_and_fits(monkeypatch, caplog):
    import spinwheel.threads as th

    monkeypatch.setenv("SPINWHEEL_THREADS", "offf")
    with caplog.at_level("WARNING", logger="spinwheel.threads"):
        assert th.enabled() == os.path.exists("/proc/stat")
    assert "SPINWHEEL_THREADS='offf' is not auto, on or off: the thread count is fitted" in caplog.text


def test_fit_threads_samples_the_real_machine():
    busy, own, waits = threads.sample_cpu() if threads.enabled() else (0.0, 0.0, {"1": 0})
    assert busy >= 0.0 and own >= 0.0 and waits and min(waits.values()) >= 0


def test_serve_passes_num_threads_to_the_engine_process(monkeypatch):
    serve = importlib.import_module("spinwheel.server.serve")  # the module (the package exports the function)
    specs = []

    class Captured(Exception):
        pass

    def fake_process(spec, *args, **kwargs):
        specs.append(spec)
        raise Captured

    monkeypatch.setattr(serve, "EngineProcess", fake_process)
    for given, passed in ((1, 1), (0, None)):
        with pytest.raises(Captured):
            serve.build_server(serve.ServeConfig(model="test", num_threads=given, warmup=False))
        assert specs[-1].num_threads == passed
    with pytest.raises(ValueError, match="--num-threads"):
        serve.ServeConfig(model="test", num_threads=-1)
