"""What an RL run is built from: the prompts (the built-in task's splits or a JSONL) and the algorithm object
(PPO with its critic learner on the policy's layout, restored when resuming)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from spinwheel.models.hf import load_model
from spinwheel.models.tokenizer import TokenizerError
from spinwheel.models.transformer import scalar_head_model
from spinwheel.rl.llm.algorithms import GroupPolicyGradient
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.ppo import PPO
from spinwheel.rl.llm.rollout import Prompt, prompts_from_task
from spinwheel.rl.llm.trpo import TRPO
from spinwheel.tasks.arithmetic import ArithmeticTask
from spinwheel.tasks.data import DataError, RLRecord, check_integer_answers, describe_skipped, read_rl_jsonl
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.learners import Learner, LocalLearner, OptimConfig, ParallelLearner


def load_prompts(
    config: RLConfig, tokenizer, max_context: int | None = None, log: Callable[[str], None] = print
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) prompts: the built-in arithmetic task's splits, or ``--data`` split by ``eval_fraction``.

    With ``max_context`` (the model's ``max_position_embeddings``), ``--data`` prompts that leave no room for
    ``--max-new-tokens`` are skipped, counted in one line to ``log`` naming their ``path:line``; fewer than two
    prompts left (one to train on, one held out) is a :class:`DataError`."""
    if config.data is None:
        task = ArithmeticTask(config.task)
        return prompts_from_task(tokenizer, task.train), prompts_from_task(tokenizer, task.test)
    records = read_rl_jsonl(config.data)
    if config.reward == "task" and config.reward_model is None:
        check_integer_answers(records)
    plain = iter(prompts_from_task(tokenizer, [r for r in records if r.messages is None]))
    rows = [next(plain) if r.messages is None else chat_prompt(tokenizer, r, config.data) for r in records]
    if max_context is not None:
        room = max_context - config.max_new_tokens
        skipped = [f"{r.where} ({len(p.ids)} tokens)" for r, p in zip(records, rows) if len(p.ids) > room]
        if skipped:
            why = (
                f"do not fit the model's context of {max_context} tokens with --max-new-tokens {config.max_new_tokens}"
            )
            log(f"{config.data}: " + describe_skipped(skipped, "prompts", why))
            rows = [p for p in rows if len(p.ids) <= room]
    if len(rows) < 2:
        raise DataError(
            f"{config.data}: {len(rows)} usable prompt(s); RL needs at least 2 (one to train on, one held out "
            "for evaluation)"
        )
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(config.seed)).tolist()
    num_eval = max(1, int(len(rows) * config.eval_fraction))
    return [rows[i] for i in order[num_eval:]], [rows[i] for i in order[:num_eval]]


def chat_prompt(tokenizer, record: RLRecord, path: str) -> Prompt:
    """A ``messages`` line rendered with the tokenizer's chat template and the assistant's generation prompt; the
    template writes its own special tokens (BOS), so the text is tokenized without adding them again."""
    try:
        text = tokenizer.apply_chat_template(record.messages, add_generation_prompt=True)
    except TokenizerError as e:
        raise DataError(f"{path}: 'messages' lines need the checkpoint's chat template: {e}") from None
    return Prompt(text, tuple(tokenizer.encode(text, add_special_tokens=False)), record.answer)


def make_algorithm(
    config: RLConfig, initial_policy, distributed: bool, dims, critic_dir: Path | None, resume_step: int = 0
):
    """The configured algorithm; PPO builds its critic (a scalar-head copy of the initial policy's body, or the
    saved critic when resuming) on a learner of the policy's layout."""
    if config.algo == "trpo":
        return TRPO(config)
    if config.algo != "ppo":
        return GroupPolicyGradient(config)
    if critic_dir is not None:
        critic_model = load_model(critic_dir, dtype=config.dtype, device=config.device)
    else:
        critic_model = scalar_head_model(initial_policy(), seed=config.seed)
    optim = OptimConfig(config.critic_lr, 0.0, config.grad_clip)
    critic: Learner = (
        ParallelLearner(critic_model, optim, config.parallel, dims, engine_copy="none")
        if distributed
        else LocalLearner(critic_model, optim)
    )
    algo = PPO(config, critic)
    if critic_dir is not None:
        state = load_trainer_state(critic_dir)
        if state is None or state["step"] != resume_step:
            raise ValueError(
                f"{critic_dir} does not match the policy checkpoint at step {resume_step} (the run "
                "stopped between the two saves); rerun with --no-resume to start over"
            )
        critic.load(critic_dir, state)
        algo.kl.load_state_dict(state["kl_coef"])
    return algo
