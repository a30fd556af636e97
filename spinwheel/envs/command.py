"""``spinwheel envs``: list the environments, write scripted-expert demonstrations for SFT.

spinwheel envs list
spinwheel envs expert --env calculator --num 2000 --out traces.jsonl
spinwheel sft --data traces.jsonl --max-new-tokens 24 ...     # trained on the model's segments only
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

from spinwheel.envs.expert import write_expert_traces
from spinwheel.envs.registry import BUILTINS, load_env


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "envs",
        help="RL environments: list the built-ins, write expert demonstrations for SFT",
        description="RL environments (--env of the RL commands): list the built-ins, or write a scripted "
        "expert's episodes as SFT segments lines (spinwheel sft --data trains on the model's segments only).",
    )
    actions = p.add_subparsers(dest="envs_command", required=True, metavar="ACTION")
    actions.add_parser("list", help="the built-in environments", description="The built-in environments.")
    e = actions.add_parser(
        "expert",
        help="write a scripted expert's episodes as SFT segments lines (JSONL)",
        description="Write a scripted expert's episodes (seeds --first-seed ..) as SFT segments lines, each "
        "checked by replaying it through the environment.",
    )
    e.add_argument(
        "--env", required=True, help="a built-in (see 'spinwheel envs list'), module:Class, reasoning-gym:NAME"
    )
    e.add_argument(
        "--env-arg",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the environment (repeatable)",
    )
    e.add_argument("--num", type=int, default=1000, help="episodes to write (default 1000)")
    e.add_argument("--out", required=True, help="the JSONL file to write")
    e.add_argument("--split", choices=("train", "test"), default="train", help="the split the episodes come from")
    e.add_argument("--first-seed", type=int, default=0, help="seed of the first episode (default 0)")


def run(ns: argparse.Namespace) -> int:
    if ns.envs_command == "list":
        for name, cls in BUILTINS.items():
            options = [f"{p.name}={p.default}" for p in inspect.signature(cls).parameters.values() if p.name != "split"]
            print(f"{name}: {(cls.__doc__ or '').strip().splitlines()[0]}\n    --env-arg {' '.join(options)}")
        print("reasoning-gym:NAME: one step: a reasoning-gym dataset (pip install 'spinwheel[envs]')")
        return 0
    out = Path(ns.out)
    if out.is_dir() or not out.parent.is_dir():
        why = "is a directory" if out.is_dir() else f"is in a directory that does not exist ({out.parent})"
        raise ValueError(f"--out {ns.out} {why}: give the path of the JSONL file to write")
    factory = load_env(ns.env, ns.env_arg)
    summary = write_expert_traces(factory, ns.env, ns.out, ns.num, ns.split, ns.first_seed)
    print(
        f"wrote {int(summary['episodes'])} expert episodes of {ns.env} ({ns.split} split, seeds {ns.first_seed}.."
        f"{ns.first_seed + ns.num - 1}, mean reward {summary['mean_reward']:.3f}) to {ns.out}"
    )
    return 0
