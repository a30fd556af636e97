"""Options of the LLM policy-gradient runs (``spinwheel grpo | rloo | reinforce-pp --help``), validated once here.

One dataclass for the shared loop (model, prompts, rollouts, optimisation, logging) and the GRPO-family knobs;
the algorithm is the command's choice (``algo``). Defaults follow the measured recipe for the demo's tiny model
(shared/MEASURED.md): small constant learning rate, G = 8, temperature 1, β = 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from spinwheel.config import check_ranges, option, redefault
from spinwheel.engine.config import EngineConfig
from spinwheel.rl.llm.algorithm_options import AGENT_ALGOS, ALGORITHM_OPTIONS, OPTIONS
from spinwheel.train.run_config import RunConfig

RL_ENGINE_DEFAULTS = {"cpu_packed_weights": False}  # where the RL loop's engine differs from EngineConfig's defaults


@dataclass
@redefault(
    data=option(None, help="RL JSONL with {prompt, answer} lines; default: the built-in task"),
    out_dir="runs/grpo",
    steps=option(200, help="rollout steps (each: generate, score, update)"),
    lr=5e-5,
    seed=option(
        0,
        help="seed of the prompt order and of every sample (a function of seed, step, prompt, "
        "sample: the same completions in one process and under any torchrun layout)",
    ),
)
class RLConfig(RunConfig):
    """Policy-gradient post-training on rollouts from spinwheel's own engine (built-in task or your JSONL)."""

    algo: str = option(
        "grpo", help="the algorithm: the command's name (spinwheel.rl.llm.algorithms.ALGORITHMS)", group="algorithm"
    )
    reward: str = option(
        "task",
        help="'task' (exact match of the answer) or a Python function 'module:function' "
        "taking (completions, answers) and returning one float per completion",
        group="model and data",
    )
    reward_model: str | None = option(
        None,
        help="reward-model checkpoint (spinwheel rm) scoring prompt+completion (instead of --reward)",
        group="model and data",
    )
    reward_timeout_s: float | None = option(
        300.0,
        help="seconds one step's reward call (function or reward model) may take; past it the run stops with an "
        "error (Ctrl-C also stops the wait)",
        group="model and data",
    )
    env: str | None = option(
        None,
        help="environment of the episodes: a built-in (arithmetic, dataset, calculator, guess), 'module:Class' or "
        "'reasoning-gym:NAME'; default: one-step episodes of the built-in task or --data, scored by --reward",
        group="model and data",
    )
    env_arg: tuple[str, ...] = option(
        (), help="the environment's options as key=value (repeatable)", group="model and data", repeat=True
    )
    chat: Literal["auto", "on", "off"] = option(
        "auto",
        help="render raw-text prompts and observations (environments, reasoning-gym, plain --data prompts) with the "
        "model's chat template and its generation prompt, environment answers as user turns (auto: when the "
        "tokenizer has a template of its own, not the built-in char one; off: raw text)",
        group="model and data",
    )
    system_prompt: str | None = option(
        None,
        help="system message opening every conversation without one of its own (needs the chat template)",
        group="model and data",
    )
    answer_extraction: Literal["auto", "last-number", "answer-tag", "boxed", "tag-or-text", "none"] = option(
        "auto",
        help="reasoning-gym: what of the reply score_answer compares (auto: the last number when the task's answers "
        "are numbers, else the last <answer>...</answer> or the whole reply; none: the whole reply)",
        group="model and data",
    )
    agent: str | None = option(
        None,
        help="a black-box agent 'module:function' or 'path/to/file.py:function', agent(openai_client, task) -> "
        "reward, trained on the tokens its calls made the policy sample (instead of --env; grpo, rloo, reinforce-pp)",
        group="model and data",
    )
    agent_tasks: str | None = option(
        None,
        help="the agent's tasks, task(seed, split) -> dict (default: task of --agent's module)",
        group="model and data",
    )
    agent_timeout_s: float = option(
        120.0, help="seconds one agent run may take; past it its episode fails", group="rollout"
    )
    max_turns: int | None = option(
        None, help="model turns per episode at most (default: the environment's)", group="rollout"
    )
    max_episode_tokens: int | None = option(
        None, help="tokens per episode at most, observations included (default: the model's context)", group="rollout"
    )
    env_timeout_s: float = option(
        30.0, help="seconds an environment's reset or step may take; past it the episode fails", group="rollout"
    )
    prompts_per_step: int = option(8, help="prompts per rollout step", group="rollout")
    group_size: int = option(8, help="completions sampled per prompt (G)", group="rollout")
    max_new_tokens: int = option(8, help="max tokens per completion", group="rollout")
    temperature: float = option(
        1.0,
        help="sampling temperature of the rollouts; the loss uses the same tempered policy (logits / T), as TRL "
        "and verl",
        group="rollout",
    )
    top_p: float = option(1.0, help="nucleus sampling of the rollouts", group="rollout")
    epochs: int = option(1, help="optimisation passes over each rollout batch (μ)", group="optimizer")
    minibatches: int = option(
        1, help="optimizer steps per pass: the rollout batch is cut into this many minibatches", group="optimizer"
    )
    beta: float = option(
        0.0, help="KL coefficient to the frozen reference policy (0: no reference model)", group="algorithm"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = option("k3", help="per-token KL estimator", group="algorithm")
    eps_low: float = option(0.2, help="lower clip range of the ratio (1 - eps_low)", group="algorithm")
    eps_high: float = option(
        0.2, help="upper clip range (1 + eps_high); above eps_low: clip-higher (DAPO)", group="algorithm"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = option(
        "token-mean", help="loss aggregation over tokens and sequences", group="algorithm"
    )
    scale_rewards: bool = option(
        True,
        help="GRPO: divide group advantages by the group std (--no-scale-rewards "
        "with --loss-agg seq-mean-token-sum-norm is Dr. GRPO)",
        group="algorithm",
    )
    dynamic_sampling: bool = option(
        False, help="drop groups whose rewards are all equal from the loss (DAPO)", group="algorithm"
    )
    gamma: float = option(1.0, help="ppo: discount of the per-token rewards", group="algorithm")
    lam: float = option(
        1.0, help="ppo: GAE λ (1: Monte-Carlo advantages, as verl; measured better here than 0.95)", group="algorithm"
    )
    critic_lr: float = option(
        1e-4, help="ppo: learning rate of the critic (a scalar-head copy of the policy)", group="optimizer"
    )
    value_clip: float | None = option(
        0.2, help="ppo: clip range of the value loss around the rollout values", group="algorithm"
    )
    whiten_advantages: bool = option(
        True, help="ppo: whiten the GAE advantages over the batch's tokens", group="algorithm"
    )
    kl_target: float | None = option(
        None,
        help="ppo: target KL per sequence for the adaptive β controller (Ziegler et al.); default: a fixed --beta",
        group="algorithm",
    )
    kl_horizon: float = option(10000.0, help="ppo: horizon (samples) of the adaptive β controller", group="algorithm")
    max_kl: float = option(
        2e-3, help="trpo: trust-region radius δ on the mean per-token KL(π_old ‖ π_new)", group="algorithm"
    )
    cg_iters: int = option(5, help="trpo: conjugate-gradient iterations", group="algorithm")
    cg_damping: float = option(
        1.0,
        help="trpo: damping added to the Fisher-vector products (large for LLMs: a batch's Fisher is nearly singular)",
        group="algorithm",
    )
    fisher_fraction: float = option(
        1.0,
        help="trpo: fraction of the rollout rows (every k-th) the conjugate gradient's Fisher-vector products use; "
        "the gradient and the KL check use all (baselines' TRPO: 0.2)",
        group="algorithm",
    )
    tis_cap: float | None = option(
        None,
        help="truncated importance sampling: weight tokens by min(π_trainer / "
        "π_engine, C) to correct sampler/trainer mismatch (e.g. 2.0)",
        group="algorithm",
    )
    max_staleness: int | None = option(
        None,
        help="asynchronous rollouts: a producer thread samples the next steps' episodes while the trainer updates, "
        "loading new weights between engine steps; episodes older than K updates at training time are dropped "
        "(0: the synchronous run exactly; default: the synchronous loop; one process, or under torchrun with "
        "--rollout-ranks)",
        group="rollout",
    )
    rollout_ranks: int | None = option(
        None,
        help="disaggregated placement under `spinwheel launch --nproc-per-node N`: the last R ranks only generate "
        "(engine, environments, rewards) and send each step's episodes to trainer rank 0, which broadcasts the "
        "weights to them in buckets after each update; the other N - R ranks train data-parallel (no --tp/--pp); "
        "with --max-staleness K the rollout ranks may run K updates ahead (default 0: the synchronous run)",
        group="rollout",
    )
    kv_on_update: Literal["keep", "recompute"] = option(
        "keep",
        help="with --max-staleness: what new weights do to the sequences they find running: keep their KV (stale, "
        "as PipelineRL) or recompute it (each is prefilled again, prompt and sampled tokens, under the new weights)",
        group="rollout",
    )
    rollout_engine: Literal["thread", "process"] = option(
        "thread",
        help="with --max-staleness: the producer's engine steps on a thread of this process, or in a child process "
        "of its own that takes each update's weights through shared memory (restarted if it dies)",
        group="rollout",
    )
    mis_cap: float | None = option(
        None,
        help="sequence-level masked importance sampling: drop from the loss the sequences whose ratio "
        "prod_t pi_trainer / pi_engine lies outside [1/C, C] (e.g. 2.0)",
        group="algorithm",
    )
    # The loop's engine samples from plain weights: oneDNN-packed copies would be repacked after every update, and
    # at RL rollout sizes packing does not speed sampling up (BENCHMARKS.md, GRPO vs TRL).
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(**RL_ENGINE_DEFAULTS), metadata={"cli": False})

    def __post_init__(self) -> None:
        check_algorithm_options(self)
        super().__post_init__()
        check_ranges(
            self,
            at_least_1=("prompts_per_step", "max_new_tokens", "epochs", "minibatches"),
            non_negative=("beta", "eps_low", "eps_high"),
            positive=("critic_lr", "max_kl", "cg_iters", "kl_horizon", "kl_target", "tis_cap"),
            unit_interval=("gamma", "lam"),
            fraction=("top_p", "fisher_fraction"),
        )
        check_ranges(self, at_least_1=("max_turns", "max_episode_tokens"), positive=("env_timeout_s",))
        check_ranges(self, non_negative=("max_staleness",), at_least_1=("mis_cap", "rollout_ranks"))
        check_async_options(self)
        if self.env is not None and (self.data is not None or self.reward != "task" or self.reward_model):
            raise ValueError(
                "--env takes its prompts and rewards from the environment: drop --data / --reward / --reward-model "
                "(a JSONL with a reward function is --env dataset --env-arg data=PATH reward=module:function)"
            )
        check_agent_options(self)
        if self.system_prompt is not None and self.chat == "off":
            raise ValueError("--system-prompt needs chat rendering: drop --chat off, or drop --system-prompt")
        if self.answer_extraction != "auto" and not (self.env or "").startswith("reasoning-gym:"):
            raise ValueError("--answer-extraction acts for --env reasoning-gym:NAME; drop it for this run")
        if self.env_arg and self.env is None:
            raise ValueError("--env-arg passes options to an environment: give --env too")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (group baselines need two samples), got {self.group_size}")
        if self.reward_timeout_s is not None and not 0 < self.reward_timeout_s < float("inf"):
            raise ValueError(f"--reward-timeout-s must be a number of seconds > 0, got {self.reward_timeout_s}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 for sampled rollouts, got {self.temperature}")
        if self.kl_target is not None and self.beta == 0:
            raise ValueError("--kl-target adapts --beta: give a starting --beta > 0")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ValueError(
                f"--minibatches {self.minibatches} must divide the rollout batch of "
                f"{self.prompts_per_step} × {self.group_size} completions"
            )

    @property
    def rollout_batch(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def updates_per_step(self) -> int:
        return self.epochs * self.minibatches


def check_algorithm_options(config: RLConfig) -> None:
    """Refuse (one line) an unknown algorithm, or an option that does not act for the run's algorithm but was set
    away from its default."""
    if config.algo not in OPTIONS:
        raise ValueError(f"--algo must be one of {', '.join(OPTIONS)}, got {config.algo!r}")
    own, defaults = OPTIONS[config.algo], {f.name: f.default for f in fields(config)}
    for name in sorted(ALGORITHM_OPTIONS - own):
        if getattr(config, name) != defaults[name]:
            acting = ", ".join(sorted(own)) or "none"
            raise ValueError(
                f"--{name.replace('_', '-')} does not act for {config.algo} (its own options: {acting}); drop it"
            )


def check_async_options(config: RLConfig) -> None:
    """One-line refusals of the rollout producer's options where they cannot act."""
    if config.max_staleness is None:
        if config.kv_on_update != "keep" or config.rollout_engine != "thread":
            raise ValueError("--kv-on-update and --rollout-engine act on the rollout producer: give --max-staleness K")


def check_agent_options(config: RLConfig) -> None:
    """One-line refusals of what ``--agent`` does not combine with (:mod:`~spinwheel.rl.llm.agents.agent_run`)."""
    if config.agent is None:
        if config.agent_tasks is not None:
            raise ValueError("--agent-tasks gives the tasks of --agent: give --agent too")
        return
    if config.algo not in AGENT_ALGOS:
        raise ValueError(f"--agent trains with {', '.join(AGENT_ALGOS)}, not {config.algo}")
    if config.env is not None or config.data is not None or config.reward != "task" or config.reward_model:
        raise ValueError(
            "--agent takes its tasks and rewards from the agent: drop --env / --data / --reward / --reward-model"
        )
    if config.max_staleness is not None:
        raise ValueError("--agent runs the synchronous loop: drop --max-staleness")
    if not 0 < config.agent_timeout_s < float("inf"):
        raise ValueError(f"--agent-timeout-s must be a number of seconds > 0, got {config.agent_timeout_s}")
