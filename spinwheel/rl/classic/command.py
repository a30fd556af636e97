"""The ``spinwheel classic`` command: train a policy, or evaluate a saved ``policy.pt`` (``--eval PATH``).

What a user sees, one line each: a ``--steps`` that is not a whole number of rollouts says how many steps will
run; a bad option, an unknown environment id or a missing MuJoCo prints ``spinwheel classic: error: …`` naming
the fix (exit 2); Ctrl-C stops after the current update, saves ``policy.pt``, ``metrics.jsonl`` and the
learning curve and exits 130 (SIGTERM: 143); a second Ctrl-C in a single process quits at once, without saving. Under
``torchrun`` every rank runs this and only rank 0 prints; torchrun forwards its SIGINT to the ranks, so repeated
signals there only confirm the first.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from spinwheel import config as cli_config
from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.envs import make_env

PREFIX = "spinwheel classic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training options (one per :class:`ClassicConfig` field) and ``--eval``."""
    cli_config.add_arguments(parser, ClassicConfig)
    group = parser.add_argument_group("evaluation of a saved policy")
    group.add_argument(
        "--eval",
        metavar="POLICY_PT",
        default=None,
        help="instead of training, evaluate this policy.pt: deterministic actions on --eval-episodes "
        "episodes, the same seeded episodes as the run's final evaluation",
    )


def run(ns: argparse.Namespace) -> int:
    """Run the command from parsed options; returns the exit code (0, 2 for bad input, 130 when interrupted)."""
    main_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        if ns.eval is not None:
            return _evaluate(ns.eval, ns.eval_episodes, main_rank)
        return _train(cli_config.from_args(ClassicConfig, ns), main_rank)
    except (ValueError, OSError) as e:  # FileNotFoundError is an OSError
        if main_rank:
            print(f"{PREFIX}: error: {e}", file=sys.stderr)
        return 2


def _evaluate(path: str, num_episodes: int, main_rank: bool) -> int:
    from spinwheel.rl.classic.outputs import evaluate_saved

    if num_episodes < 1:
        raise ValueError(f"--eval needs --eval-episodes ≥ 1, got {num_episodes}")
    if not os.path.isfile(path):
        why = "is a directory" if os.path.isdir(path) else "does not exist"
        raise ValueError(f"--eval {path} {why}: give a policy.pt that spinwheel classic wrote (in its --out-dir)")
    result = evaluate_saved(path, num_episodes)
    if main_rank:
        print(
            f"evaluation of {path} ({result['algo']}, {result['env']}): return {result['eval_return_mean']:.1f} ± "
            f"{result['eval_return_std']:.1f} over {num_episodes} episodes"
        )
    return 0


def _train(config: ClassicConfig, main_rank: bool) -> int:
    from spinwheel.parallel.launch import launched_world_size
    from spinwheel.rl.classic.loop import train

    make_env(config.env).close()  # an unknown id or a missing MuJoCo fails here, on every rank, before any group
    run_steps = config.num_updates * config.rollout_size
    if main_rank and run_steps != config.steps:
        print(
            f"note: --steps {config.steps} is not a multiple of one rollout (num_envs × num_steps = "
            f"{config.rollout_size}); training {run_steps} steps ({config.num_updates} updates)"
        )
    with _stop_on_signal(hard_stop=launched_world_size() == 1) as stop:
        result = train(config, stop)
    code = 128 + (stop.signum or signal.SIGINT)  # 130 for Ctrl-C, 143 for SIGTERM
    if not main_rank:
        return code if result.get("interrupted") else 0
    if result.get("interrupted"):
        print(
            f"interrupted: saved policy.pt, metrics.jsonl and learning_curve.png in {result['out_dir']} after update "
            f"{result['updates']} of {result['num_updates']} ({result['env_steps']} steps)"
        )
        return code
    print(f"evaluation: return {result['eval_return_mean']:.1f} ± {result['eval_return_std']:.1f}")
    return 0


class _StopEvent(threading.Event):
    """Set by SIGINT or SIGTERM; ``signum`` says which."""

    signum: int | None = None


@contextmanager
def _stop_on_signal(hard_stop: bool) -> Iterator[_StopEvent]:
    """While training, SIGINT and SIGTERM set the returned event (the loop stops after the update, as every
    training command does, :mod:`spinwheel.train.interrupt`); with ``hard_stop`` a second SIGINT raises
    ``KeyboardInterrupt``. Outside the main thread signals cannot be caught: no handler."""
    stop = _StopEvent()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: object) -> None:
        if stop.is_set() and hard_stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.signum = stop.signum or signum
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
