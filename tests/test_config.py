"""Config dataclasses as options (spinwheel/config.py): the range checks every config makes, a subclass's own
defaults for the fields it inherits, and the shared --help groups."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

import pytest

from spinwheel.cli import main
from spinwheel.config import GROUPS, add_arguments, check_ranges, option, redefault
from spinwheel.parallel.mesh import ParallelError
from spinwheel.preference.pref_config import DPOConfig, PreferenceConfig, RMConfig
from spinwheel.train.run_config import RunConfig
from spinwheel.train.sft.sft_config import SFTConfig


@dataclass
class Ranges:
    n: int | None = 1
    x: float = 0.5


@pytest.mark.parametrize(
    "kind,value,message",
    [
        ("at_least_1", 0, "--n must be >= 1, got 0"),
        ("non_negative", -1, "--n must be >= 0, got -1"),
        ("positive", 0, "--n must be > 0, got 0"),
        ("unit_interval", 2, "--n must be in [0, 1], got 2"),
        ("open_unit_interval", 1, "--n must be in (0, 1), got 1"),
        ("fraction", 0, "--n must be in (0, 1], got 0"),
    ],
)
def test_each_range_says_what_to_change(kind, value, message):
    check_ranges(Ranges(n=None), **{kind: ("n",)})  # unset passes
    with pytest.raises(ValueError) as e:
        check_ranges(Ranges(n=value), **{kind: ("n", "x")})
    assert str(e.value) == message


def test_range_messages_keep_each_configs_spelling():
    with pytest.raises(ParallelError, match=r"^n must be ≥ 1, got 0$"):
        check_ranges(Ranges(n=0), at_least_1=("n",), name=str, ge="≥", error=ParallelError)
    check_ranges(Ranges(n=1, x=1.0), at_least_1=("n",), fraction=("x",), unit_interval=("n", "x"))


def test_a_subclass_redefaults_inherited_fields_in_place():
    assert SFTConfig().steps == 1500 and RunConfig().steps == 200 and RMConfig().steps == 600
    assert PreferenceConfig().out_dir == "runs/pref" and DPOConfig().out_dir == "runs/dpo"
    names = [f.name for f in dataclasses.fields(SFTConfig)]
    assert names[: names.index("batch_size")] == [f.name for f in dataclasses.fields(RunConfig)]  # places kept
    steps = {f.name: f for f in dataclasses.fields(SFTConfig)}["steps"]
    assert steps.metadata == {f.name: f for f in dataclasses.fields(RunConfig)}["steps"].metadata  # help, group
    model = {f.name: f for f in dataclasses.fields(RMConfig)}["model"]
    assert model.metadata["help"].startswith("checkpoint (or preset) to start from: an LM gets a fresh score head")
    assert model.metadata["group"] == "model and data"
    with pytest.raises(TypeError, match="no inherited field 'stepz'"):
        redefault(stepz=1)(type("Bad", (RunConfig,), {}))


def test_options_land_in_the_shared_groups_in_order():
    @dataclass
    class Options:
        own: int = option(0, help="an option without a group")
        steps: int = option(1, help="run length", group="run")
        lr: float = option(1.0, help="learning rate", group="optimizer")

    parser = argparse.ArgumentParser()
    add_arguments(parser, Options)
    titles = [g.title for g in parser._action_groups if g._group_actions]
    assert titles[-3:] == ["Options", "optimizer", "run"]
    with pytest.raises(ValueError, match="unknown option group 'speed'"):
        add_arguments(argparse.ArgumentParser(), Options, group="speed", skip={"steps", "lr"})


@pytest.mark.parametrize(
    "command,groups",
    [
        ("sft", ["model and data", "optimizer", "run", "parallel layout"]),
        ("grpo", list(GROUPS)),
        ("dpo", list(GROUPS)),
        ("rm", ["model and data", "rollout", "optimizer", "run", "parallel layout", "engine"]),
        ("classic", ["model and data", "rollout", "algorithm", "optimizer", "run", "parallel layout"]),
    ],
)
def test_help_shows_the_shared_groups(command, groups, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    shown = [t for t in re.findall(r"^(\S[^:\n]*):$", text, re.M) if t in GROUPS]
    assert shown == groups
    run = text.split("\nrun:\n")[1].split("\n\n", 2)[1]
    assert "--steps" in run and "--lr " not in run
