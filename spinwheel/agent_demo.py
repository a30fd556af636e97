"""The agent story (``spinwheel demo --agent``): the built-in tiny model learns to use a calculator tool, in minutes on
a CPU.

1. **expert traces** of the ``calculator`` environment (3-digit × 2-digit products) by a tool-shy demonstrator: it
   calls the tool (``317*46=`` → ``<calc>317*46</calc>`` → ``=14582`` → ``14582``) on every problem whose second
   factor is 50 or more, but multiplies by a smaller one in its head (``317*23=`` → ``7291``, which a
   0.5M-parameter model cannot imitate), calling the tool on only a tenth of those;
2. a short **SFT** of the randomly initialised ``tiny`` preset on them (the model's turns only): it copies the tool's
   answer well, but like its teacher it answers most small-factor problems in its head, and wrongly;
3. **GRPO** with the tool: multi-turn episodes on spinwheel's engine, rewarded by the final answer's correctness —
   the model learns to call the tool on every problem;
4. held-out task success (greedy episodes on the test split) after SFT and after GRPO, the share of the correct
   episodes that called the tool, and two episodes of the GRPO policy with their tool calls.

Everything is written under ``<out-dir>/agent/`` (``traces.jsonl``, ``sft/``, ``grpo/``); ``spinwheel demo``'s own
``sft/`` and ``grpo/`` beside it are left alone. The same recipe as commands::

    spinwheel envs expert --env spinwheel.agent_demo:ToolShyCalculator --num 4000 --out traces.jsonl
    spinwheel sft --data traces.jsonl --steps 300 --warmup-steps 50 --max-new-tokens 24 --out-dir runs/agent-sft
    spinwheel grpo --model runs/agent-sft/checkpoint --env calculator --steps 150 --prompts-per-step 16 \\
        --group-size 8 --lr 2e-4 --max-new-tokens 20 --out-dir runs/agent-grpo
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spinwheel.envs.base import Segment
from spinwheel.envs.calculator import CalculatorEnv

if TYPE_CHECKING:
    from spinwheel.rl.llm.episode_tokens import Episode

DemoConfig = Any  # spinwheel.demo.DemoConfig (which imports this module when --agent is given)
MARKER = "spinwheel-demo.json"  # spinwheel.demo.MARKER: one demo directory holds both stories


class ToolShyCalculator(CalculatorEnv):
    """``calculator`` whose expert multiplies by a small second factor (below ``head_below``) in its head, calling the
    tool on only a ``tool_rate`` share of those problems, and calls the tool on every other problem; the environment
    itself is ``calculator``'s."""

    def __init__(self, split: str = "train", tool_rate: float = 0.1, head_below: int = 50, **options: Any) -> None:
        super().__init__(split, **options)
        if isinstance(tool_rate, bool) or not isinstance(tool_rate, (int, float)) or not 0 <= tool_rate <= 1:
            raise ValueError(f"tool_rate must be a number in [0, 1], got {tool_rate!r}")
        if isinstance(head_below, bool) or not isinstance(head_below, int):
            raise ValueError(f"head_below must be an integer, got {head_below!r}")
        self.tool_rate, self.head_below = float(tool_rate), head_below

    def expert(self, seed: int) -> list[Segment]:
        segments = super().expert(seed)
        _, b = self.problem(seed)
        if b >= self.head_below or random.Random(f"tool-shy:{self.split}:{seed}").random() < self.tool_rate:
            return segments
        return [segments[0], segments[-1]]  # the problem, then the answer without the tool


@dataclass(frozen=True)
class Recipe:
    """The measured recipe (issue 23's report): what the demo's SFT and GRPO stages run besides their step counts."""

    traces: int = 4000
    tool_rate: float = 0.1  # of the problems whose second factor is below head_below; the others: always the tool
    head_below: int = 50
    sft_warmup_steps: int = 50
    sft_max_new_tokens: int = 24  # the <calc>…</calc> turn is 19 characters of the char model: one token each
    grpo_prompts: int = 16
    grpo_group_size: int = 8
    grpo_lr: float = 2e-4
    grpo_temperature: float = 1.0
    grpo_max_new_tokens: int = 20


RECIPE = Recipe()


def prepare_agent_dir(out: Path) -> Path:
    """``out/agent``, emptied if a previous demo wrote it (``out``: locked and checked by
    :func:`spinwheel.demo.lock_out_dir` — new, empty or a demo's directory)."""
    if not (out / MARKER).is_file():
        (out / MARKER).write_text(json.dumps({"written_by": "spinwheel demo"}) + "\n")
    agent = out / "agent"
    if agent.is_dir():
        shutil.rmtree(agent)
    elif agent.exists():
        agent.unlink()
    agent.mkdir()
    return agent


def held_out(checkpoint: Path, num: int) -> tuple[list[Episode], Any]:
    """Greedy episodes of ``calculator``'s test split (seeds 0..num-1) of ``checkpoint``, as the RL run evaluates;
    returns them and the checkpoint's tokenizer."""
    from spinwheel.engine import LLM
    from spinwheel.envs import load_env
    from spinwheel.rl.llm.episodes import EpisodeConfig, EpisodeGroup, run_episodes

    llm = LLM(str(checkpoint), device="cpu", cpu_packed_weights=False)
    make_env = load_env("calculator")
    groups = [EpisodeGroup([make_env("test")], seed, seed) for seed in range(num)]
    episode_config = EpisodeConfig(max_new_tokens=RECIPE.grpo_max_new_tokens, temperature=0.0)
    return run_episodes(llm.engine, groups, episode_config, 0, -1, None, {}), llm.tokenizer


def success(episodes: list[Episode]) -> tuple[float, float | None]:
    """(the share of correct episodes, the share of the correct ones that called the tool; None: none correct)."""
    correct = [e for e in episodes if e.info.get("correct", 0.0) > 0]
    tool = sum(e.info.get("tool_calls", 0.0) >= 1 for e in correct)
    return len(correct) / max(1, len(episodes)), (tool / len(correct) if correct else None)


def _share(value: float | None) -> str:
    return "-- (none correct)" if value is None else f"{value:.0%}"


def transcript(episode: Episode, tokenizer) -> str:
    """One line: the environment's text as it is, the model's turns in [brackets], then ok / WRONG."""
    parts, start = [], episode.prompt_len
    parts.append(tokenizer.decode(episode.token_ids[:start]))
    i = start
    while i < len(episode.token_ids):
        j = i
        while j < len(episode.token_ids) and episode.mask[j] == episode.mask[i]:
            j += 1
        text = tokenizer.decode(episode.token_ids[i:j]).replace("\n", "\\n")
        parts.append(f"[{text}]" if episode.mask[i] else text)
        i = j
    verdict = "ok" if episode.info.get("correct", 0.0) > 0 else "WRONG"
    return f"{''.join(parts):<44} {verdict}"


def run_agent_demo(config: DemoConfig) -> dict:
    """SFT on tool-shy expert traces → GRPO with the calculator tool → held-out success before/after."""
    from spinwheel.envs.expert import expert_rows
    from spinwheel.rl.llm import RLConfig, train_rl
    from spinwheel.train.sft.sft import train_sft
    from spinwheel.train.sft.sft_config import SFTConfig

    r, t0 = RECIPE, time.perf_counter()
    agent = prepare_agent_dir(Path(config.out_dir))
    common = dict(seed=config.seed, num_threads=config.num_threads, progress=config.progress, resume=False)
    traces = agent / "traces.jsonl"
    make_env = lambda split: ToolShyCalculator(split, r.tool_rate, r.head_below)  # noqa: E731
    rows = expert_rows(make_env, f"{__name__}:ToolShyCalculator", r.traces)
    traces.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    tool = sum(len(row["segments"]) > 2 for row in rows) / len(rows)
    print(
        f"spinwheel demo --agent: 1/3 {len(rows)} expert episodes of calculator (3-digit × 2-digit products): the "
        f"expert calls the tool <calc>…</calc> on {tool:.0%} of them and answers the others in its head (most of "
        f"those whose second factor is below {r.head_below})"
    )
    print(f"spinwheel demo --agent: 2/3 SFT of the 'tiny' preset on them, {config.agent_sft_steps} steps")
    sft_config = SFTConfig(
        data=str(traces),
        out_dir=str(agent / "sft"),
        steps=config.agent_sft_steps,
        warmup_steps=min(r.sft_warmup_steps, config.agent_sft_steps),
        max_new_tokens=r.sft_max_new_tokens,
        eval_examples=min(config.eval_examples, 100),
        eval_every=0,
        save_every=0,
        **common,
    )
    train_sft(sft_config)
    sft_ckpt = agent / "sft" / "checkpoint"
    print(
        f"spinwheel demo --agent: 3/3 GRPO with the calculator tool from {sft_ckpt}, {config.agent_grpo_steps} "
        f"steps of {r.grpo_prompts} problems × {r.grpo_group_size} episodes"
    )
    rl_config = RLConfig(
        algo="grpo",
        model=str(sft_ckpt),
        env="calculator",
        out_dir=str(agent / "grpo"),
        steps=config.agent_grpo_steps,
        prompts_per_step=r.grpo_prompts,
        group_size=r.grpo_group_size,
        lr=r.grpo_lr,
        temperature=r.grpo_temperature,
        max_new_tokens=r.grpo_max_new_tokens,
        eval_examples=config.eval_examples,
        eval_every=0,
        save_every=100,
        **common,
    )
    train_rl(rl_config)
    return report(config, agent, sft_ckpt, t0)


def report(config: DemoConfig, agent: Path, sft_ckpt: Path, t0: float) -> dict:
    """Print held-out success and tool use of the SFT and GRPO checkpoints, and two problems as each played them
    (the first two the SFT model answered without the tool, where there are two); return the figures."""
    n = config.eval_examples
    before, _ = held_out(sft_ckpt, n)
    after, tokenizer = held_out(agent / "grpo" / "checkpoint", n)
    (sft_ok, sft_tool), (grpo_ok, grpo_tool) = success(before), success(after)
    called = [sum(e.info.get("tool_calls", 0.0) >= 1 for e in eps) / max(1, len(eps)) for eps in (before, after)]
    print(
        f"\nheld-out task success ({n} problems never trained on, greedy episodes): after SFT {sft_ok:.1%} -> "
        f"after GRPO {grpo_ok:.1%}\nepisodes that called the tool: {called[0]:.0%} -> {called[1]:.0%}; correct "
        f"episodes that called the tool: {_share(sft_tool)} -> {_share(grpo_tool)}"
    )
    by_seed = {e.env_seed: e for e in after}
    shy = [e for e in before if e.info.get("tool_calls", 0.0) < 1 and e.env_seed in by_seed]
    shown = (shy + [e for e in before if e not in shy])[:2]
    print(
        f"two held-out problems{' the SFT model answered without the tool' if len(shy) >= 2 else ''} (the model's "
        "turns in [brackets], the tool's answers after =):"
    )
    for episode in shown:
        print(f"  after SFT   {transcript(episode, tokenizer)}")
        if episode.env_seed in by_seed:
            print(f"  after GRPO  {transcript(by_seed[episode.env_seed], tokenizer)}")
    print(
        f"wrote {agent / 'traces.jsonl'}, {agent / 'sft'} and {agent / 'grpo'} (checkpoint/ in HF format, "
        f"metrics.jsonl, curves.png) in {time.perf_counter() - t0:.0f}s"
    )
    return {"eval_sft": sft_ok, "eval_grpo": grpo_ok, "tool_sft": sft_tool, "tool_grpo": grpo_tool, "called": called}
