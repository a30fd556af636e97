"""``spinwheel serve``: load a checkpoint into the engine and serve it over HTTP with uvicorn.

By default the engine runs in a process of its own (:mod:`~spinwheel.server.engine_process`), so the model's steps
and the HTTP work do not share one GIL; ``--no-engine-process`` keeps it on a thread of the server's process.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from spinwheel.config import check_ranges, option
from spinwheel.engine import EngineConfig, LLMEngine
from spinwheel.engine.kernels.warmup import prepare_for_serving
from spinwheel.engine.parallel.pp_engine import engine_class
from spinwheel.models.lora_io import read_adapter_config
from spinwheel.server.app import OpenAIServer
from spinwheel.server.background import UvicornThread
from spinwheel.server.engine_client import EngineProcess
from spinwheel.server.engine_process import EngineSpec
from spinwheel.server.limits import ServerLimits, fit_connections_to_fd_limit
from spinwheel.server.logs import install_repeat_filter
from spinwheel.server.middleware import check_api_key
from spinwheel.server.transport import resolve_http, resolve_loop


@dataclass
class ServeConfig(ServerLimits):
    """OpenAI-compatible HTTP server."""

    model: str = option(
        "runs/demo/grpo/checkpoint",
        help="HF checkpoint directory, Hugging Face Hub id (owner/name, through the local HF cache), preset, a GGUF "
        "file (or a directory holding one), a named model (smollm2-135m-instruct), or a PEFT adapter directory (its "
        "base with the adapter folded in)",
    )
    host: str = option("127.0.0.1", help="address to bind (loopback unless told otherwise)")
    port: int = option(8000, help="TCP port")
    api_key: str | None = option(
        None,
        help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and "
        "/detokenize (default: $SPINWHEEL_API_KEY if set)",
    )
    served_model_name: str | None = option(
        None, help="model id clients send (default: the --model directory's name, or the preset name)"
    )
    lora: list[str] = option(
        None,
        help="LoRA adapters served beside the model, unmerged and mixed in one batch: NAME=DIR (or DIR, named after "
        "its directory), PEFT adapter directories trained on --model; a request's model field NAME picks one "
        "(vLLM's --lora-modules)",
        default_factory=list,
    )
    max_body_mb: float = option(1.0, help="largest accepted request body, MiB (larger: HTTP 413)")
    log_level: str = option("info", help="uvicorn log level")
    http: Literal["auto", "httptools", "h11"] = option(
        "auto", help="HTTP/1.1 parser: httptools (C) or h11 (pure Python); auto: httptools when installed"
    )
    loop: Literal["auto", "uvloop", "asyncio"] = option(
        "auto", help="event loop of the HTTP server: uvloop (libuv) or asyncio's own; auto: uvloop when installed"
    )
    engine_process: bool = option(
        True,
        help="run the engine in a process of its own, so that model steps and HTTP work do not share a GIL "
        "(--no-engine-process: on a thread of the server's process)",
    )
    num_threads: int = option(
        0,
        help="torch CPU threads of the engine, at most (0: torch's default, one per core); each step runs on as "
        "many as the cores other processes leave free (SPINWHEEL_THREADS=off: exactly this many)",
    )
    warmup: bool = option(
        True,
        help="before serving, run one engine step of dummy prompts filling --engine-max-num-batched-tokens, so "
        "that the first burst of requests does not pay first-time costs (allocations, oneDNN kernels); "
        "vLLM runs such a step at start-up too",
    )
    decode_step_ms: float = option(
        200.0,
        help="with --warmup and no --engine-max-num-batched-tokens-with-decodes: a step that also decodes takes "
        "the prompt tokens the timed warm-up step says fit in this many ms, so that a burst of new prompts holds "
        "up the running streams about this long at most (Sarathi-Serve sizes its budget against an inter-token "
        "latency target the same way); 0: the whole budget. Without --warmup the bound is 768 tokens",
    )
    special_tokens_in_content: bool = option(
        True,
        help="a special token's text typed in a chat message (<eos>, <|im_end|>) becomes that token, as vLLM's "
        "server does; --no-special-tokens-in-content reads message content as text only",
    )
    engine_restarts: int = option(
        3,
        help="times an engine process that died is started again (its requests in flight get 503 error "
        "objects); after that the server exits with the reason",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        check_ranges(self, positive=("max_body_mb",), non_negative=("decode_step_ms", "num_threads", "engine_restarts"))
        resolve_http(self.http)  # ValueError now, not after the engine has loaded
        resolve_loop(self.loop)
        self.loras()

    def loras(self) -> dict[str, str]:
        """``--lora`` as name -> adapter directory; a bad entry, a repeated name or a directory that is no adapter
        spinwheel can serve is a one-line ValueError (before the model loads)."""
        out: dict[str, str] = {}
        for entry in self.lora:
            name, _, path = entry.partition("=") if "=" in entry else (_dir_name(entry), "", entry)
            if not name or not path:
                raise ValueError(f"--lora {entry!r}: give NAME=DIR (a name and a PEFT adapter directory)")
            if name in out or name == model_name(self):
                raise ValueError(f"--lora: the name '{name}' is taken (by another adapter or the served model)")
            read_adapter_config(path)  # LoRAError (a ValueError) naming the file and what is wrong
            out[name] = path
        return out

    def limits(self) -> ServerLimits:
        return ServerLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ServerLimits)})


def model_name(config: ServeConfig) -> str:
    return config.served_model_name or _dir_name(config.model)


def _dir_name(path: str) -> str:
    """A model's name from its directory: ``runs/demo/grpo/checkpoint`` -> ``grpo``, ``runs/x`` -> ``x``."""
    p = Path(path)
    return (p.parent.name if p.name == "checkpoint" else p.name) or str(path)


SERVING_TOKENS_WITH_DECODES = 768


def serving_defaults(config: EngineConfig) -> EngineConfig:
    """The engine options a server without a warm-up defaults differently from offline generation: a step that
    decodes takes at most 768 tokens (or ``max_num_seqs``), so that a burst of new prompts does not stall the
    streams already running (offline, where only throughput counts, every step may take
    ``max_num_batched_tokens``). With the warm-up, :func:`~spinwheel.engine.kernels.warmup.prepare_for_serving` fits the
    bound to ``--decode-step-ms`` instead."""
    if config.max_num_batched_tokens_with_decodes is not None:
        return config
    cap = min(config.max_num_batched_tokens, max(SERVING_TOKENS_WITH_DECODES, config.max_num_seqs))
    return dataclasses.replace(config, max_num_batched_tokens_with_decodes=cap)


def build_server(
    config: ServeConfig,
    engine_config: EngineConfig | None = None,
    on_engine_exit: Callable[[str], None] | None = None,
) -> OpenAIServer:
    """The server of ``spinwheel serve``; with an engine process, ``on_engine_exit(reason)`` is called when it has
    died for good (see :class:`EngineProcess`)."""
    api_key = config.api_key or os.environ.get("SPINWHEEL_API_KEY")
    check_api_key(api_key)  # before the checkpoint loads: a key no client can send is a startup error
    engine_config = engine_config or EngineConfig()
    # the budget of a step that decodes: given, fitted to --decode-step-ms by the warm-up, or serving_defaults'
    fit_ms = config.decode_step_ms if engine_config.max_num_batched_tokens_with_decodes is None else None
    if not config.warmup:
        engine_config = serving_defaults(engine_config)
    engine: LLMEngine | EngineProcess
    if config.engine_process:
        threads = config.num_threads or None
        spec = EngineSpec(
            config.model,
            engine_config,
            num_threads=threads,
            warmup=config.warmup,
            decode_step_ms=fit_ms,
            loras=config.loras(),
        )
        engine = EngineProcess(spec, config.engine_restarts, on_engine_exit)
    else:
        if config.num_threads:  # the engine's thread, started later, takes this count
            import torch

            torch.set_num_threads(config.num_threads)
        engine = engine_class(engine_config).from_pretrained(config.model, engine_config)
        for name, path in config.loras().items():
            engine.add_lora(name, path)
        if config.warmup:
            print(f"spinwheel serve: {prepare_for_serving(engine, fit_ms)}", flush=True)
    max_body = int(config.max_body_mb * (1 << 20))
    return OpenAIServer(
        engine, model_name(config), api_key, max_body, config.limits(), config.special_tokens_in_content
    )


def check_listen(host: str, port: int) -> None:
    """A ``--host``/``--port`` the server could not listen on is one line before the checkpoint loads (uvicorn's own
    comes after the engine's start and warm-up, among its log lines, with exit status 3)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing one is no error
            s.bind(address)
    except OSError as e:
        why = e.strerror or str(e)
        raise ValueError(f"cannot listen on {host}:{port} ({why}); choose another --port or --host") from None


def serve(config: ServeConfig, engine_config: EngineConfig | None = None) -> None:
    import uvicorn

    check_listen(config.host, config.port)
    max_connections, note = fit_connections_to_fd_limit(config.max_connections)
    if note:
        print(f"spinwheel serve: {note}", flush=True)
    config = dataclasses.replace(config, max_connections=max_connections)
    engine_gone: list[str] = []
    http_server: list[uvicorn.Server] = []

    def on_engine_exit(reason: str) -> None:  # from the engine client's reader thread
        engine_gone.append(reason)
        logging.getLogger("spinwheel.server").error("%s; the server stops", reason)
        if http_server:
            http_server[0].should_exit = True

    try:
        server = build_server(config, engine_config, on_engine_exit)
    except RuntimeError as e:  # the engine process could not start: say why in one line (status 2, as bad options)
        print(f"spinwheel serve: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    s = server.engine.stats()
    where = f"process pid {server.engine.pid}" if isinstance(server.engine, EngineProcess) else "in-process"
    adapters = "".join(f", LoRA adapter '{n}' from {p}" for n, p in config.loras().items())
    print(
        f"spinwheel serve: '{server.model_name}' from {config.model}{adapters}; KV cache {s.num_blocks} blocks of "
        f"{server.engine.config.block_size} tokens; max_model_len {server.engine.max_model_len}; engine {where}; "
        f"HTTP {resolve_http(config.http)} on {resolve_loop(config.loop)}; http://{config.host}:{config.port}/v1",
        flush=True,
    )
    # configures logging
    uvicorn_config = server.uvicorn_config(config.host, config.port, config.log_level, config.http, config.loop)
    install_repeat_filter(config.log_repeat_interval_s)
    # What startup made (modules, the tokenizer, FastAPI's routes: ~2 x 10^5 objects) leaves the collector's view: a
    # connection flood allocates long-lived transports and protocols fast enough to trigger full collections, and
    # each would traverse all of it (~0.6 s of 5,000 half-open connections' handling, ahead of the next request).
    gc.collect()
    gc.freeze()
    http_server.append(uvicorn.Server(uvicorn_config))
    try:
        http_server[0].run()
    finally:
        server.shutdown()
    if engine_gone:
        raise SystemExit(f"spinwheel serve: error: {engine_gone[0]}")


class BackgroundServer(UvicornThread):
    """Run a server on a free loopback port in a background thread (tests, benchmarks, notebooks)."""

    def __init__(
        self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0, http: str = "auto", loop: str = "auto"
    ) -> None:
        super().__init__(host, port)
        self.server = server
        self.serve(server.uvicorn_config(self.host, self.port, "warning", http, loop))

    def stopped(self) -> None:
        self.server.shutdown()
