"""The ``spinwheel`` command. Each subcommand's options come from a typed config dataclass
(see :mod:`spinwheel.config`); ``spinwheel <command> --help`` documents every field."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spinwheel.config import add_arguments, from_args, option

if TYPE_CHECKING:
    from spinwheel.engine import EngineConfig
from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.train.sft_config import SFTConfig


@dataclass
class GenerateConfig:
    """Generate completions from a checkpoint or preset."""

    model: str = option("runs/demo/grpo/checkpoint", help="HF checkpoint directory or built-in preset")
    prompt: list[str] = option(None, help="prompt(s) to complete", default_factory=lambda: ["12+34="])
    max_tokens: int = option(32, help="max new tokens per prompt")
    temperature: float = option(0.0, help="sampling temperature (0: greedy)")
    seed: int = option(0, help="sampling seed")
    chat: bool = option(False, help="wrap each prompt as a user message with the tokenizer's chat template")
    device: str = option("cpu", help="torch device")
    dtype: str | None = option(None, help="parameter dtype (default: the checkpoint's)")

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")


def run_generate(config: GenerateConfig, engine: EngineConfig | None = None) -> list[str]:
    """Complete the prompts with the serving engine (paged KV cache, continuous batching); ``engine``: its options
    (``--engine-*``; ``--device`` / ``--dtype`` of the command win over the engine's)."""
    from spinwheel.engine import LLM, EngineConfig, SamplingParams

    options = dataclasses.asdict(engine or EngineConfig())
    options.update(dtype=config.dtype, device=config.device)
    llm = LLM(config.model, **options)
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    if config.chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in config.prompt]
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]  # the template writes BOS
    else:
        prompts = list(config.prompt)
        ids = tokenizer.encode_batch(prompts)
    params = SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens, seed=config.seed)
    texts = []
    for prompt, out in zip(prompts, llm.generate(ids, params)):
        if out.error:
            raise ValueError(f"prompt {prompt!r}: {out.error}")
        texts.append(out.outputs[0].text)
        print(f"{prompt}{out.outputs[0].text}")
    return texts


def _sft_parser(sub: argparse._SubParsersAction, name: str, help: str, defaults: SFTConfig) -> None:
    p = sub.add_parser(name, help=help, description=help)
    add_arguments(p, SFTConfig)
    add_arguments(p, ArithmeticConfig, prefix="task-")
    if name == "sft":  # under torchrun: spinwheel sft --dp/--tp/--pp/--zero/--fsdp/...
        from spinwheel.parallel import ParallelConfig

        add_arguments(p, ParallelConfig)
    p.set_defaults(**{f.name: getattr(defaults, f.name) for f in dataclasses.fields(SFTConfig)
                      if f.metadata.get("cli") is not False})


def _sft_from_args(ns: argparse.Namespace) -> SFTConfig:
    from spinwheel.parallel import ParallelConfig

    config = from_args(SFTConfig, ns)
    config.task = from_args(ArithmeticConfig, ns, prefix="task-")
    config.parallel = from_args(ParallelConfig, ns)  # defaults (one process) where the command has no such options
    return config


_RL_COMMANDS = {
    "grpo": "GRPO (group-relative advantages; Dr. GRPO, clip-higher, dynamic sampling as options) on engine rollouts",
    "rloo": "RLOO (leave-one-out baseline) on engine rollouts",
    "reinforce-pp": "REINFORCE++ (KL in the reward, batch-whitened returns) on engine rollouts",
    "ppo": "PPO for LLMs (critic, token-level GAE, KL penalty to the reference) on engine rollouts",
    "trpo": "TRPO for LLM policies (conjugate gradient on Fisher-vector products, KL trust region) on engine rollouts",
}


def _rl_parser(sub: argparse._SubParsersAction, algo: str, what: str) -> None:
    from spinwheel.engine import EngineConfig
    from spinwheel.parallel import ParallelConfig
    from spinwheel.rl.llm.config import RLConfig

    p = sub.add_parser(algo, help=what, description=f"{what}; torchrun for data/tensor/pipeline parallel updates")
    add_arguments(p, RLConfig, skip={"algo"})
    add_arguments(p, ArithmeticConfig, prefix="task-")
    add_arguments(p, ParallelConfig)
    add_arguments(p, EngineConfig, prefix="engine-", skip={"dtype", "device", "seed", "max_model_len"})
    p.set_defaults(out_dir=f"runs/{algo}")


def _run_rl(ns: argparse.Namespace) -> None:
    from spinwheel.engine import EngineConfig
    from spinwheel.parallel import ParallelConfig
    from spinwheel.rl.llm import RLConfig, train_rl

    config = from_args(RLConfig, ns)
    config.algo = ns.command
    config.task = from_args(ArithmeticConfig, ns, prefix="task-")
    config.parallel = from_args(ParallelConfig, ns)
    config.engine = from_args(EngineConfig, ns, prefix="engine-")
    result = train_rl(config)
    if result.get("eval_after") is not None and os.environ.get("RANK", "0") == "0":
        before = result.get("eval_before")
        print(f"held-out exact match: {'' if before is None else f'{before:.1%} -> '}{result['eval_after']:.1%}; "
              f"wrote {result['checkpoint']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spinwheel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from spinwheel.demo import DemoConfig

    p = sub.add_parser("demo", help="the main job: SFT then GRPO of the built-in tiny model on 2-digit addition",
                       description=DemoConfig.__doc__)
    add_arguments(p, DemoConfig)
    _sft_parser(sub, "sft", "supervised fine-tuning (built-in arithmetic task or --data JSONL)", SFTConfig())
    from spinwheel.engine import EngineConfig

    for algo, what in _RL_COMMANDS.items():
        _rl_parser(sub, algo, what)
    p = sub.add_parser("generate", help="complete prompts with a checkpoint")
    add_arguments(p, GenerateConfig)
    add_arguments(p, EngineConfig, prefix="engine-", skip={"dtype", "device"})
    from spinwheel.server.serve import ServeConfig

    from spinwheel.rl.classic import command as classic_command

    p = sub.add_parser("classic", help="policy-gradient RL (VPG / TRPO / PPO) on a gymnasium environment",
                       description="VPG, TRPO, PPO-clip or PPO-penalty (--ppo-variant) on a gymnasium environment "
                                   "(torchrun for data parallel); --eval PATH evaluates a saved policy.pt")
    classic_command.add_arguments(p)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                       description="OpenAI-compatible HTTP server on the paged-attention engine")
    add_arguments(p, ServeConfig)
    add_arguments(p, EngineConfig, prefix="engine-")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command == "demo":
            from spinwheel.demo import DemoConfig, run_demo

            run_demo(from_args(DemoConfig, ns))
        elif ns.command == "sft":
            from spinwheel.train.sft import train_sft

            result = train_sft(_sft_from_args(ns))
            if "eval_after" in result:
                print(f"held-out exact match: {result['eval_after']['exact_match']:.1%}")
        elif ns.command in _RL_COMMANDS:
            _run_rl(ns)
        elif ns.command == "generate":
            from spinwheel.engine import EngineConfig

            run_generate(from_args(GenerateConfig, ns), from_args(EngineConfig, ns, prefix="engine-"))
        elif ns.command == "classic":
            from spinwheel.rl.classic import command as classic_command

            return classic_command.run(ns)
        elif ns.command == "serve":
            from spinwheel.engine import EngineConfig
            from spinwheel.server.serve import ServeConfig, serve

            serve(from_args(ServeConfig, ns), from_args(EngineConfig, ns, prefix="engine-"))
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        # Bad input (configs, checkpoints, data files): one line naming the problem, no traceback.
        print(f"spinwheel {ns.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
