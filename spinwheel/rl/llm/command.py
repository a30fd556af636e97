"""The LLM post-training commands: ``spinwheel grpo | rloo | reinforce-pp | ppo | trpo`` (the RL loop on the
engine's rollouts) and ``spinwheel dpo | rm`` (preference pairs), their options built from the config dataclasses."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, TypeVar

from spinwheel.config import add_arguments, from_args
from spinwheel.tasks.arithmetic import ArithmeticConfig

if TYPE_CHECKING:
    from spinwheel.preference.pref_config import PreferenceConfig
    from spinwheel.rl.llm.config import RLConfig

Config = TypeVar("Config", "RLConfig", "PreferenceConfig")


def rl_commands() -> dict[str, str]:
    """The RL commands (one per registered algorithm) and their one-line help."""
    from spinwheel.rl.llm.algorithms import ALGORITHMS

    return {name: algo.summary for name, algo in ALGORITHMS.items()}


class _Refused(argparse.Action):
    """An option of another algorithm given to this command: refused in one line naming whose it is."""

    def __init__(self, *args, owners: str = "", **kwargs) -> None:
        super().__init__(*args, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.owners = owners

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        command = parser.prog.split()[-1]
        parser.exit(
            2, f"{parser.prog}: error: {option_string} does not act for {command} (an option of {self.owners})\n"
        )


def _add_run_parts(p: argparse.ArgumentParser, engine_defaults: dict | None = None) -> None:
    """The task, layout and engine options of every LLM training command (the engine takes the run's placement,
    seed and context length)."""
    from spinwheel.engine import EngineConfig
    from spinwheel.parallel import ParallelConfig

    add_arguments(p, ArithmeticConfig, prefix="task-", group="model and data")
    add_arguments(p, ParallelConfig, group="parallel layout")
    skip = {"dtype", "device", "seed", "max_model_len"}
    add_arguments(p, EngineConfig, prefix="engine-", skip=skip, defaults=engine_defaults, group="engine")


def _with_run_parts(config: Config, ns: argparse.Namespace) -> Config:
    """``config`` with the task, layout and engine that :func:`_add_run_parts` options give."""
    from spinwheel.engine import EngineConfig
    from spinwheel.parallel import ParallelConfig

    config.task = from_args(ArithmeticConfig, ns, prefix="task-")
    config.parallel = from_args(ParallelConfig, ns)
    config.engine = from_args(EngineConfig, ns, prefix="engine-")
    return config


def add_rl_parser(sub: argparse._SubParsersAction, algo: str, what: str) -> None:
    """The command of algorithm ``algo``: the shared options and its own; another algorithm's are refused."""
    from spinwheel.rl.llm.algorithms import ALGORITHM_OPTIONS, ALGORITHMS
    from spinwheel.rl.llm.config import RL_ENGINE_DEFAULTS, RLConfig

    cls = ALGORITHMS[algo]
    p = sub.add_parser(
        algo,
        help=what,
        description=f"{what}; torchrun for data/tensor/pipeline parallel updates; "
        "rerunning resumes from <out-dir>/checkpoint.",
    )
    foreign = ALGORITHM_OPTIONS - cls.options
    add_arguments(p, RLConfig, skip={"algo"} | foreign, defaults=cls.defaults)
    _add_run_parts(p, RL_ENGINE_DEFAULTS)
    p.add_argument(  # under torchrun: engines over the ranks, resharded into (spinwheel/rl/llm/rollouts/engine_tp.py)
        "--engine-tp",
        dest="engine_tensor_parallel_size",
        type=int,
        default=argparse.SUPPRESS,
        help="--engine-tensor-parallel-size under torchrun: engines split over N training ranks each (N dividing "
        "the world size: world/N engines), weights resharded from the trainer's layout after each update, no rank "
        "holding the whole model",
    )
    for name in sorted(foreign):
        owners = ", ".join(a for a, c in ALGORITHMS.items() if name in c.options)
        flag = name.replace("_", "-")
        p.add_argument(f"--{flag}", f"--no-{flag}", dest=f"refused_{name}", action=_Refused, owners=owners)
    p.set_defaults(out_dir=f"runs/{algo}", algo=algo)


def run_rl(ns: argparse.Namespace) -> None:
    from spinwheel.rl.llm import RLConfig, train_rl

    config = _with_run_parts(from_args(RLConfig, ns), ns)
    result = train_rl(config)
    if result.get("eval_after") is not None and os.environ.get("RANK", "0") == "0":
        before, what = result.get("eval_before"), result.get("eval_label", "exact match")
        form = ".1%" if what == "exact match" else ".4g"  # a user's reward has no fixed scale
        shown = ("" if before is None else f"{before:{form}} -> ") + f"{result['eval_after']:{form}}"
        print(f"held-out {what}: {shown}; wrote {result['checkpoint']}")


PREF_COMMANDS = {
    "dpo": "DPO (sigmoid, conservative label smoothing, IPO) on preference pairs: JSONL, or self-generated from "
    "the policy's samples by the task reward",
    "rm": "reward model (Bradley-Terry on preference pairs), saved as an HF *ForSequenceClassification checkpoint",
}


def add_pref_parser(sub: argparse._SubParsersAction, command: str, what: str) -> None:
    from spinwheel.preference.pref_config import DPOConfig, RMConfig

    cls = DPOConfig if command == "dpo" else RMConfig
    p = sub.add_parser(command, help=what, description=f"{what}; torchrun for data/tensor parallel updates.")
    add_arguments(p, cls)
    _add_run_parts(p)
    p.set_defaults(out_dir=f"runs/{command}")


def run_pref(ns: argparse.Namespace) -> None:
    from spinwheel.preference.dpo import train_dpo
    from spinwheel.preference.pref_config import DPOConfig, RMConfig
    from spinwheel.preference.reward_model import train_rm

    config = _with_run_parts(from_args(DPOConfig if ns.command == "dpo" else RMConfig, ns), ns)
    result = (train_dpo if ns.command == "dpo" else train_rm)(config)
    if os.environ.get("RANK", "0") == "0":
        after = result.get("eval_after") or {}
        shown = ", ".join(f"{k} {v:.4g}" for k, v in after.items() if isinstance(v, (int, float)))
        print(f"held-out: {shown or 'not evaluated'}; wrote {result.get('checkpoint', config.out_dir)}")
