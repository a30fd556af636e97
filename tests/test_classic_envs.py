"""A MuJoCo environment whose extra is half installed (``mujoco`` without ``imageio``) is one line naming the
extra to install, not a traceback; other environments' missing imports are one line too."""

from __future__ import annotations

import sys

import gymnasium as gym
import pytest

from spinwheel.cli import main
from spinwheel.rl.classic.envs import MUJOCO_INSTALL, make_env


@pytest.fixture
def imageio_missing(monkeypatch):
    """gym.make as it behaves with ``mujoco`` installed but not ``imageio``: the environment's constructor
    imports gymnasium's MuJoCo renderer, whose ``import imageio`` fails."""
    monkeypatch.setitem(sys.modules, "imageio", None)  # `import imageio` now raises ModuleNotFoundError

    def make(env_id, **kwargs):
        import imageio  # noqa: F401

    monkeypatch.setattr(gym, "make", make)


def test_a_mujoco_env_without_imageio_names_the_extra(imageio_missing):
    with pytest.raises(ValueError, match="^Hopper-v5 needs the MuJoCo extra \\(imageio is not installed\\); run ") as e:
        make_env("Hopper-v5")
    assert str(e.value).endswith(MUJOCO_INSTALL)


def test_the_classic_command_prints_it_on_one_line(imageio_missing, capsys):
    assert main(["classic", "--env", "Hopper-v5"]) == 2
    err = capsys.readouterr().err
    message = f"Hopper-v5 needs the MuJoCo extra (imageio is not installed); run {MUJOCO_INSTALL}"
    assert err == f"spinwheel classic: error: {message}\n"


def test_another_env_missing_a_module_is_one_line(imageio_missing):
    with pytest.raises(ValueError, match="^CartPole-v1 needs a package that is not installed: imageio"):
        make_env("CartPole-v1")
