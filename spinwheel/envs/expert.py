"""Scripted-expert demonstrations: an environment's ``expert(seed)`` episodes, checked by replaying them through
the environment, written as SFT ``segments`` lines (``spinwheel envs expert``; ``spinwheel sft --data`` trains on
the model's segments only)::

    {"segments": [{"text": "317*46=", "model": false}, {"text": "<calc>317*46</calc>", "model": true},
                  {"text": "=14582\\n", "model": false}, {"text": "14582", "model": true}],
     "env": "calculator", "split": "train", "seed": 0, "reward": 1.0}

(``env``, ``split``, ``seed`` and ``reward`` say where the line came from; the SFT reader ignores them.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spinwheel.envs.base import Action, Env, EnvError, Segment


def replay(env: Env, seed: int, segments: list[Segment]) -> tuple[float, dict[str, float]]:
    """Play an expert episode through ``env``: each model segment is a turn, and the first segment and every later
    environment segment must be what ``env`` answers. Returns (the episode's total reward, its last ``info``); a
    trace that disagrees with the environment is a ValueError naming where."""
    if not segments or segments[0].model:
        raise ValueError("an expert episode starts with the environment's first observation")
    first = env.reset(seed)
    if isinstance(first, str) and first != segments[0].text:
        raise ValueError(f"segment 0 is {segments[0].text!r} but reset({seed}) gave {first!r}")
    total, i = 0.0, 1
    while i < len(segments):
        if not segments[i].model:
            raise ValueError(f"segment {i} should be the model's turn, got an environment segment")
        step = env.step(Action(segments[i].text, []))
        total += step.reward
        i += 1
        if step.done:
            if i != len(segments):
                raise ValueError(f"the episode ended at segment {i - 1} but the trace goes on")
            return total, step.info
        if i == len(segments) or segments[i].model or segments[i].text != step.observation:
            got = "nothing" if i == len(segments) else repr(segments[i].text)
            raise ValueError(f"segment {i} should be the observation {step.observation!r}, got {got}")
        i += 1
    raise ValueError("the trace ended before the episode did")


def expert_rows(
    make_env: Callable[[str], Env], label: str, num_episodes: int, split: str = "train", first_seed: int = 0
) -> list[dict[str, Any]]:
    """``num_episodes`` checked expert episodes (seeds ``first_seed`` on) as SFT ``segments`` rows."""
    rows = []
    for seed in range(first_seed, first_seed + num_episodes):
        segments = make_env(split).expert(seed)
        if segments is None:
            raise EnvError(f"--env {label}: the environment has no scripted expert (its expert() returned None)")
        try:
            reward, _ = replay(make_env(split), seed, segments)
        except (ValueError, RuntimeError) as e:
            raise EnvError(f"--env {label}: the expert's episode {seed} does not replay: {e}") from None
        row = {"segments": [{"text": s.text, "model": s.model} for s in segments], "env": label, "split": split}
        rows.append({**row, "seed": seed, "reward": reward})
    return rows


def write_expert_traces(
    make_env: Callable[[str], Env],
    label: str,
    path: str | os.PathLike[str],
    num_episodes: int,
    split: str = "train",
    first_seed: int = 0,
) -> dict[str, float]:
    """Write :func:`expert_rows` to ``path`` (JSONL); returns ``episodes`` and ``mean_reward``."""
    if num_episodes < 1:
        raise ValueError(f"--num must be >= 1, got {num_episodes}")
    rows = expert_rows(make_env, label, num_episodes, split, first_seed)
    with Path(path).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {"episodes": float(len(rows)), "mean_reward": sum(r["reward"] for r in rows) / len(rows)}
