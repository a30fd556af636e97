"""The engine core in its own process: it only schedules and runs steps (what vLLM V1's ``EngineCore`` does).

A server that steps the engine on a thread of its own process shares one GIL between the model's Python work and
the event loop's HTTP, JSON and streaming work; each slows the other. Here the engine runs in a child process
(``multiprocessing`` spawn, so no CUDA or thread state is forked), started and spoken to by
:mod:`~spinwheel.engine.process`'s :class:`~spinwheel.engine.process.EngineCoreProcess` (one duplex pipe,
length-prefixed pickles; this module's :class:`ProcessCore` is its :class:`~spinwheel.engine.process.PipeCore`):

- server -> engine: lists of commands, ``("add", request_id, prompt_token_ids, SamplingParams)``,
  ``("abort", request_id)``, ``("stop", request_id, index, stop_string)`` (one sample hit a stop string),
  ``("shutdown",)``; the core's reader thread queues them, the core applies them between steps, so requests that
  arrive during a step join the next one together.
- engine -> server: ``("ready", EngineInfo)`` once loaded, then one ``("step", deltas, step_s, EngineSnapshot)``
  per step with what each request got in that step (new token ids, logprobs, finish reasons: no text, see
  :mod:`~spinwheel.server.output_deltas`), and ``("failed", request_ids, exception)`` for requests that could not
  be added or whose step raised.

The engine here decodes no text and checks no stop strings: its output processor has no tokenizer. The API
process detokenizes each step's new tokens, checks the stop strings and tells the engine to stop or abort.

The core exits when told to or when the pipe closes (the server went away), and ignores SIGINT: Ctrl-C in a
terminal reaches the whole process group, and the server, not the engine, decides how to stop.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from spinwheel.engine import EngineConfig, EngineStats, LLMEngine
from spinwheel.engine.isolation import INTERNAL_ERROR
from spinwheel.engine.kernels.warmup import prepare_for_serving
from spinwheel.engine.parallel.pp_engine import engine_class
from spinwheel.engine.parallel.tp_executor import TensorParallelError
from spinwheel.engine.process import PipeCore, dumps
from spinwheel.engine.sequence import SequenceGroup
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.server.async_engine import EngineStepError
from spinwheel.server.output_deltas import DeltaEncoder

logger = logging.getLogger(__name__)


@dataclass
class EngineSpec:
    """What the engine process builds its engine from (pickled to it once, at start)."""

    model: str | Transformer  # checkpoint directory, Hub id or preset; or a model, whose tensors are shared
    config: EngineConfig
    tokenizer: Tokenizer | None = None  # default: the checkpoint's (load_tokenizer)
    num_threads: int | None = None  # torch threads of the engine process (None: torch's default)
    warmup: bool = False  # run spinwheel.engine.kernels.warmup's full-budget step before saying ready
    decode_step_ms: float | None = None  # with warmup: fit the budget of a step that decodes (prepare_for_serving)
    loras: dict[str, str] = field(default_factory=dict)  # LoRA adapters to serve by name: name -> adapter directory

    def load_tokenizer(self) -> Tokenizer:
        from spinwheel.models import load_tokenizer

        if self.tokenizer is not None:
            return self.tokenizer
        if isinstance(self.model, Transformer):
            raise ValueError("an EngineSpec with a model object needs its tokenizer")
        return load_tokenizer(self.model)

    def build(self) -> LLMEngine:
        """The engine, whose output processor decodes nothing: the API process does (text prompts are still
        tokenized by ``add_request``, and EOS comes from the tokenizer), serving ``loras``."""
        engine_cls = engine_class(self.config)  # the pipeline-parallel engine with --pp > 1
        if isinstance(self.model, Transformer):
            engine = engine_cls(self.model, self.load_tokenizer(), self.config)
        else:
            engine = engine_cls.from_pretrained(self.model, self.config, self.load_tokenizer())
        for name, path in self.loras.items():
            engine.add_lora(name, path)
        engine.output_processor.tokenizer = None
        return engine

    def start(self, conn: Connection) -> tuple[ProcessCore, EngineInfo]:
        """In the engine process (:func:`~spinwheel.engine.process.serve_core`): the engine's core, and what the
        server is told of the engine."""
        engine = self.build()
        if self.warmup:
            print(f"spinwheel serve: {prepare_for_serving(engine, self.decode_step_ms)}", flush=True)
        loras = tuple(engine.loras.names)
        info = EngineInfo(os.getpid(), engine.model.config.vocab_size, engine.max_model_len, engine.stats(), loras)
        return ProcessCore(engine, conn), info


@dataclass
class EngineInfo:
    """What the server needs to know of the engine it did not build."""

    pid: int
    vocab_size: int
    max_model_len: int
    stats: EngineStats
    loras: tuple[str, ...] = ()  # the LoRA adapters it serves, by name


@dataclass
class EngineSnapshot:
    """The engine's state after a step: its stats, and the accounts a leak check reads."""

    stats: EngineStats
    has_unfinished: bool  # requests the engine holds (running, waiting, swapped, or finishing)
    num_block_tables: int  # sequences holding device or CPU blocks
    num_used_blocks: int


def picklable(e: BaseException) -> BaseException:
    """``e`` if it crosses the pipe intact, else a RuntimeError with its repr."""
    try:
        pickle.loads(dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send the text instead
        return RuntimeError(repr(e))


def snapshot(engine: LLMEngine) -> EngineSnapshot:
    bm = engine.block_manager
    return EngineSnapshot(
        engine.stats(),
        engine.has_unfinished_requests(),
        len(bm.block_tables) + len(bm.cpu_block_tables),
        bm.num_used_blocks,
    )


class ProcessCore(PipeCore):
    """The child's core: the server's commands (module docstring) applied between steps, each step's deltas back."""

    def __init__(self, engine: LLMEngine, conn: Connection, idle_wait_s: float = 1.0) -> None:
        super().__init__(engine, conn, idle_wait_s)
        self.encoder = DeltaEncoder(engine.output_processor)
        self._live: set[str] = set()  # requests added and not yet finished

    def apply(self, commands: Iterator[tuple]) -> None:
        failed: list[tuple[str, BaseException]] = []
        for command in commands:
            if command[0] == "add":
                _, request_id, prompt, params = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as e:  # a bad request: its handler gets the error, the engine keeps serving
                    failed.append((request_id, picklable(e)))
                    continue
                self._live.add(request_id)
            elif command[0] == "abort":
                self.engine.abort(command[1])  # its final output (finish_reason "abort") comes with the next step
            elif command[0] == "stop":
                self.engine.stop_sample(*command[1:])
            else:
                self.stopped = True
        for request_id, e in failed:
            self.send(("failed", [request_id], e))

    def step(self) -> list[SequenceGroup]:
        return self.engine.step_groups(stream=True)

    def deliver(self, groups: list[SequenceGroup], step_s: float) -> None:
        deltas = []
        for group in groups:
            try:
                deltas.append(self.encoder.encode(group))
            except Exception as e:  # noqa: BLE001 - one request's output could not be sent: it fails alone
                self._fail_one(group.request_id, e)
        for delta in deltas:
            if delta.finished:
                self._live.discard(delta.request_id)
        self.send(("step", deltas, step_s, snapshot(self.engine)))

    def step_failed(self, error: Exception) -> None:
        if isinstance(error, TensorParallelError):  # a worker is gone: exit, so the server fails the requests and
            print(f"spinwheel serve: engine process exits: {error}", file=sys.stderr, flush=True)  # restarts
            self.engine.executor.close()
            raise SystemExit(1) from None
        logger.exception("engine step failed; aborting the requests in flight", exc_info=error)
        self._fail_all(EngineStepError(f"the engine failed on this batch: {error!r}"))

    def _fail_one(self, request_id: str, e: Exception) -> None:
        logger.error("request %s failed encoding its output; the others go on", request_id, exc_info=e)
        self.encoder.forget(request_id)
        self.engine.abort(request_id)  # when still running; its blocks are freed with the next step
        self._live.discard(request_id)
        message = f"{INTERNAL_ERROR}the engine failed on this request's output ({type(e).__name__}: {e})"
        self.send(("failed", [request_id], EngineStepError(f"{message}; the other requests were not affected")))

    def _fail_all(self, error: Exception) -> None:
        failed = sorted(self._live)
        for request_id in failed:
            self.encoder.forget(request_id)
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - best effort; the error reaches the client either way
                logger.exception("abort of %s failed", request_id)
        self._live.clear()
        try:
            self.engine.step(stream=False)  # let the engine free the aborted requests' blocks
        except Exception:  # noqa: BLE001
            logger.exception("engine step after a failure also failed")
        self.send(("failed", failed, picklable(error)))
