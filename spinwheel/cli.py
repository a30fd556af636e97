"""The ``spinwheel`` command. Each subcommand's options come from a typed config dataclass
(see :mod:`spinwheel.config`); ``spinwheel <command> --help`` documents every field.

Bad input ends with one line, ``spinwheel <command>: error: ...``, and exit status 2; under ``torchrun`` only rank 0
prints it (every rank reads the same options and files, so every rank fails alike). An interrupted training run
exits with 130 (SIGINT) or 143 (SIGTERM) after its checkpoint is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spinwheel import commands
from spinwheel.cli_errors import Parser, check_policy_checkpoint, out_of_memory, stdout_closed, unknown_options
from spinwheel.config import add_arguments, from_args, option

if TYPE_CHECKING:
    from spinwheel.engine import EngineConfig, SamplingParams
from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.train.sft.sft_config import SFTConfig
from spinwheel.user_code import exit_despite_threads

DESCRIPTION = (
    "spinwheel: LLM post-training on PyTorch. SFT, then policy-gradient RL (GRPO, RLOO, REINFORCE++, PPO, "
    "TRPO) on rollouts from its own paged-attention engine, on one process or under torchrun; generation "
    "and an OpenAI-compatible server; VPG/TRPO/PPO on gymnasium. 'spinwheel COMMAND --help' lists a "
    "command's options."
)


@dataclass
class PlacementConfig:
    """Where the model runs (the same options, the same defaults, for generate and serve)."""

    device: str | None = option(None, help="torch device: cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    dtype: str | None = option(None, help="parameter dtype: float32, bfloat16, float16 (default: the checkpoint's)")
    seed: int = option(0, help="seed of the engine's sampling (requests without a seed of their own)")


@dataclass
class GenerateConfig:
    """Complete prompts with a checkpoint, a Hub model or a preset, on the paged-attention engine."""

    model: str = option(
        "runs/demo/grpo/checkpoint",
        help="HF checkpoint directory, Hugging Face Hub id (owner/name, through the local HF cache), preset, a GGUF "
        "file (or a directory holding one), a named model (smollm2-135m-instruct), or a PEFT adapter directory (its "
        "base with the adapter folded in)",
    )
    prompt: list[str] = option(None, help="prompt(s) to complete", default_factory=lambda: ["12+34="])
    chat: bool = option(False, help="send each prompt as a user message through the tokenizer's chat template")
    max_tokens: int = option(32, help="max new tokens per completion")
    temperature: float = option(0.0, help="sampling temperature (0: greedy)")
    top_p: float = option(1.0, help="nucleus sampling: keep the smallest set of tokens with this much probability")
    top_k: int = option(0, help="sample among the k most likely tokens (0: all)")
    n: int = option(1, help="completions per prompt")
    stop: list[str] = option(None, help="strings that end a completion (not included in it)", default_factory=list)

    def sampling_params(self) -> SamplingParams:
        from spinwheel.engine import SamplingParams

        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=list(self.stop) or None,
            max_tokens=self.max_tokens,
        )

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("--prompt needs at least one prompt")
        try:
            self.sampling_params()  # the engine's own checks, before a checkpoint loads
        except ValueError as e:
            param = getattr(e, "param", None)
            raise ValueError(f"--{param.replace('_', '-')}: {e}" if param else str(e)) from None


def format_completions(prompt: str, texts: list[str]) -> str:
    """``prompt:`` then one ``output:`` line per completion (``output i:`` when there are several); lines of
    multi-line texts continue under the first."""

    def block(label: str, text: str) -> str:
        return f"{label} " + text.replace("\n", "\n" + " " * (len(label) + 1))

    labels = ["output:"] if len(texts) == 1 else [f"output {i + 1}:" for i in range(len(texts))]
    return "\n".join([block("prompt:", prompt)] + [block(label, t) for label, t in zip(labels, texts)])


def run_generate(config: GenerateConfig, engine: EngineConfig | None = None) -> list[list[str]]:
    """Complete the prompts with the serving engine (``engine``: its options, placement included); prints each
    prompt (the user's text, not the rendered chat template) and its completions; returns the completions."""
    from spinwheel.engine import LLM, EngineConfig

    llm = LLM(config.model, **dataclasses.asdict(engine or EngineConfig()))
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    if config.chat:  # the template writes BOS itself
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in config.prompt]
        ids = [tokenizer.encode(r, add_special_tokens=False) for r in rendered]
    else:
        ids = tokenizer.encode_batch(list(config.prompt))
    texts = []
    for i, (prompt, out) in enumerate(zip(config.prompt, llm.generate(ids, config.sampling_params()))):
        if out.error:
            shown = repr(prompt) if len(prompt) <= 60 else f"{prompt[:40]!r}... ({len(prompt)} characters)"
            raise ValueError(f"prompt {shown}: {out.error}")
        texts.append([c.text for c in out.outputs])
        print(("\n" if i else "") + format_completions(prompt, texts[-1]), flush=True)
    return texts


def check_device(device: str | None) -> None:
    """A one-line error for a device this machine or this build of PyTorch cannot use, before anything loads
    (torch's own is an assertion deep inside the first ``.to()``)."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(
                f"--device {device}: {why} (torch {torch.__version__}); use --device cpu, or put a CUDA "
                "build of torch into the venv (README: set-up)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available on this machine; use --device cpu")


def _sft_parser(sub: argparse._SubParsersAction) -> None:
    from spinwheel.parallel import ParallelConfig

    what = "supervised fine-tuning (built-in arithmetic task or --data JSONL)"
    p = sub.add_parser(
        "sft",
        help=what,
        description=f"{SFTConfig.__doc__} One process, or every rank under "
        "torchrun with --dp/--tp/--pp/--zero/--fsdp; rerunning resumes from <out-dir>/checkpoint.",
    )
    add_arguments(p, SFTConfig)
    add_arguments(p, ArithmeticConfig, prefix="task-", group="model and data")
    add_arguments(p, ParallelConfig, group="parallel layout")


def _sft_from_args(ns: argparse.Namespace) -> SFTConfig:
    from spinwheel.parallel import ParallelConfig

    config = from_args(SFTConfig, ns)
    config.task = from_args(ArithmeticConfig, ns, prefix="task-")
    config.parallel = from_args(ParallelConfig, ns)
    return config


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The placement options and ``--engine-*`` (generate and serve spell them alike)."""
    from spinwheel.engine import EngineConfig

    add_arguments(p, PlacementConfig)
    add_arguments(p, EngineConfig, prefix="engine-", skip={"dtype", "device", "seed"}, group="engine")
    for short, axis, metavar in (("tp", "tensor", "N"), ("pp", "pipeline", "P")):
        p.add_argument(
            f"--{short}",
            dest=f"engine_{axis}_parallel_size",
            type=int,
            default=argparse.SUPPRESS,
            metavar=metavar,
            help=f"{axis}-parallel degree (short for --engine-{axis}-parallel-size)",
        )


def _engine_from_args(ns: argparse.Namespace) -> EngineConfig:
    """``--engine-*`` plus the placement options (``--device``, ``--dtype``, ``--seed``)."""
    from spinwheel.engine import EngineConfig

    placement = from_args(PlacementConfig, ns)
    return dataclasses.replace(
        from_args(EngineConfig, ns, prefix="engine-"),
        device=placement.device,
        dtype=placement.dtype,
        seed=placement.seed,
    )


def build_parser(running: str | None = None) -> argparse.ArgumentParser:
    """Every command's options; with ``running`` (the command to run), ``serve``'s only when it is that one: the
    server's imports (FastAPI, uvicorn) would add ~0.4 s to the start of every other command and torchrun rank."""
    from spinwheel import __version__
    from spinwheel.demo import DemoConfig
    from spinwheel.envs import command as envs_command
    from spinwheel.rl.classic import command as classic_command
    from spinwheel.rl.llm.command import PREF_COMMANDS, add_pref_parser, add_rl_parser, rl_commands

    parser = Parser(prog="spinwheel", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"spinwheel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "demo",
        help="the main job: SFT then GRPO of the built-in tiny model on 2-digit addition",
        description=DemoConfig.__doc__,
    )
    add_arguments(p, DemoConfig)
    _sft_parser(sub)
    for algo, what in rl_commands().items():
        add_rl_parser(sub, algo, what)
    for command, what in PREF_COMMANDS.items():
        add_pref_parser(sub, command, what)
    p = sub.add_parser("generate", help="complete prompts with a checkpoint", description=GenerateConfig.__doc__)
    add_arguments(p, GenerateConfig)
    _add_engine_arguments(p)
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
        description="OpenAI-compatible HTTP server on the paged-attention engine.",
    )
    if running in (None, "serve"):
        from spinwheel.server.serve import ServeConfig

        add_arguments(p, ServeConfig)
        _add_engine_arguments(p)
    commands.add_parsers(sub, running)
    p = sub.add_parser(
        "classic",
        help="policy-gradient RL (VPG / TRPO / PPO) on a gymnasium environment",
        description="VPG, TRPO, PPO-clip or PPO-penalty (--ppo-variant) on a gymnasium environment "
        "(torchrun for data parallel); --eval PATH evaluates a saved policy.pt",
    )
    classic_command.add_arguments(p)
    envs_command.add_parser(sub)
    sub.add_parser(
        "launch",
        add_help=False,
        help="torchrun for spinwheel: 'spinwheel launch --nproc-per-node 2 sft "
        "--dp 2'; exit statuses and Ctrl-C pass through without torchrun's tracebacks",
    )
    return parser


def _dispatch(ns: argparse.Namespace) -> int:
    from spinwheel.rl.llm.command import PREF_COMMANDS, rl_commands, run_pref, run_rl

    """Run the parsed command; returns its exit status."""
    check_device(getattr(ns, "device", None))
    check_policy_checkpoint(ns)
    if ns.command == "demo":
        from spinwheel.demo import DemoConfig, run_demo

        run_demo(from_args(DemoConfig, ns))
    elif ns.command == "sft":
        from spinwheel.train.sft.sft import train_sft

        train_sft(_sft_from_args(ns), announce=True)
    elif ns.command in PREF_COMMANDS:
        run_pref(ns)
    elif ns.command in rl_commands():
        run_rl(ns)
    elif ns.command == "generate":
        run_generate(from_args(GenerateConfig, ns), _engine_from_args(ns))
    elif ns.command == "classic":
        from spinwheel.rl.classic import command as classic_command

        return classic_command.run(ns)  # its own messages and exit codes
    elif ns.command == "envs":
        from spinwheel.envs import command as envs_command

        return envs_command.run(ns)
    elif ns.command == "serve":
        from spinwheel.server.serve import ServeConfig, serve

        serve(from_args(ServeConfig, ns), _engine_from_args(ns))
    else:
        return commands.run(ns) or 0
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself: threads user code left running cannot keep it alive
        return exit_despite_threads(main, sys.argv[1:])
    argv = list(argv)
    if argv[:1] == ["launch"]:
        from spinwheel.parallel.launch import launch

        return launch(argv[1:])
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    ns, extra = parser.parse_known_args(argv)
    if extra:
        unknown_options(parser, ns, extra)
    from spinwheel.train.run import NonFiniteError

    rank = int(os.environ.get("RANK", "0"))  # torchrun's; 0 in one process
    try:
        return _dispatch(ns)
    except KeyboardInterrupt as e:
        code = getattr(e, "exit_code", 130)
        if code == 130 and not hasattr(e, "exit_code") and rank == 0:
            print(f"spinwheel {ns.command}: interrupted", file=sys.stderr)
        return code
    except NonFiniteError as e:  # the run stopped before saving broken weights: one line, not a traceback
        if rank == 0:
            print(f"spinwheel {ns.command}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # another rank died: one line on each survivor (the launcher names the lost rank)
        from spinwheel.parallel.launch import lost_peer

        if (oom := out_of_memory(e)) is not None:  # each rank's own: every rank that meets it says so
            where = f" (rank {rank})" if "RANK" in os.environ else ""
            print(f"spinwheel {ns.command}: error{where}: {oom}", file=sys.stderr, flush=True)
            return 1
        if (why := lost_peer(e)) is None:
            raise
        print(f"spinwheel {ns.command}: error (rank {rank}): another rank of this run stopped ({why}); rerun the "
              "same command to resume from the last checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    except (ValueError, OSError) as e:
        if isinstance(e, BrokenPipeError) and stdout_closed():  # `spinwheel envs list | head`: the reader is gone
            return 141  # 128 + SIGPIPE, as a shell tool stopped by it
        # Bad input (configs, checkpoints, data files): one line naming the problem, no traceback. Under torchrun
        # rank 0 speaks for all; a system error (disk, permissions) may be one node's, so its rank says it too.
        node_specific = isinstance(e, OSError) and not isinstance(e, FileNotFoundError)
        if rank == 0 or node_specific:
            where = f" (rank {rank})" if rank else ""
            print(f"spinwheel {ns.command}: error{where}: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
