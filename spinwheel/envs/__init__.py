"""Environments for agentic RL (issue 23): the interface (:mod:`.base`), the built-ins — one-step ``arithmetic`` and
``dataset`` (a user's RL JSONL with ``--reward``), multi-turn ``calculator`` (a tool call) and ``guess`` — the
``reasoning-gym:NAME`` adapter, ``--env`` / ``--env-arg`` loading (:mod:`.registry`) and scripted-expert traces for
SFT (:mod:`.expert`)."""

from spinwheel.envs.base import Action, Env, EnvError, Message, Observation, Segment, Step
from spinwheel.envs.registry import BUILTINS, EnvFactory, load_env, parse_env_args
from spinwheel.envs.single import OneStepEnv, step_batch

__all__ = [
    "BUILTINS",
    "Action",
    "Env",
    "EnvError",
    "EnvFactory",
    "Message",
    "Observation",
    "OneStepEnv",
    "Segment",
    "Step",
    "load_env",
    "parse_env_args",
    "step_batch",
]
