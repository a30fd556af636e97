"""``spinwheel demo --real``: the recipe's options are a valid RL run (the run itself is the real model's, minutes
long: its figures are in BENCHMARKS.md), and the two demo stories are not mixed."""

from __future__ import annotations

from pathlib import Path

import pytest

from spinwheel.demo import DemoConfig
from spinwheel.real_demo import ENV, ENV_ARGS, MODEL, SYSTEM_PROMPT, _correct, real_config


def test_recipe_is_a_valid_grpo_lora_run(tmp_path):
    rl = real_config(DemoConfig(real=True, seed=3), tmp_path)
    assert (rl.algo, rl.model, rl.env, rl.env_arg, rl.system_prompt) == ("grpo", MODEL, ENV, ENV_ARGS, SYSTEM_PROMPT)
    assert rl.lora_rank == 16 and rl.seed == 3 and rl.eval_examples >= 200 and rl.steps == 30 and rl.lr == 5e-4
    assert rl.prompts_per_step * rl.group_size == 32 and rl.max_new_tokens == 64


def test_agent_and_real_are_refused_together():
    with pytest.raises(ValueError, match="--agent and --real"):
        DemoConfig(agent=True, real=True)


def test_correct_reads_every_evaluation(tmp_path: Path):
    m = tmp_path / "metrics.jsonl"
    m.write_text(
        '{"step": 0, "eval_correct": 0.2}\n{"step": 1, "reward_mean": 0.5}\n{"step": 30, "eval_correct": 0.45}\n'
    )
    assert _correct(m) == [(0, 0.2), (30, 0.45)]
