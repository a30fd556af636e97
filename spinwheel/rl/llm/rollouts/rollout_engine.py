"""The rollout producer's engine in a child process of its own (``--rollout-engine process``): the trainer keeps
the main process, the engine's Python work (scheduling, sampling, output processing) no longer shares its GIL.

The child holds the engine and the :class:`~spinwheel.rl.llm.rollouts.async_rollouts.VersionedEngine` around it (the
version
record, ``--kv-on-update``); :class:`EngineProcess` is the producer thread's stand-in for that engine —
``add_request``, ``step``, ``abort``, ``token_versions`` … each one command and one answer over the engine process's
pipe (:class:`~spinwheel.engine.process.EngineCoreProcess`, the class the server's engine process uses too; the
child's core is :class:`RolloutCore`), so the episode driver runs unchanged in the main process (environments and
rewards stay there). The weights live in shared memory: before a step that finds a newer published version the
producer thread copies it into the shared tensors (the child is idle between two calls, so it never reads a
half-written copy) and the step tells the child to load it; the seconds and bytes are counted (``weight_publish_s``,
``weight_publish_mb``).

Children come from the fork server that spawned ranks use (:func:`~spinwheel.parallel.launch.rank_context`: torch is
imported once, a child starts in a fraction of a second). Every answer is awaited at most ``timeout_s``: a child that
hangs fails the call in one line. A child that dies fails the call with :class:`EngineDied`; the producer then
starts a new child on the newest weights it had copied (:meth:`EngineProcess.restart`) and plays the interrupted
step again from the start — its episodes are counted as re-generated, none was handed to the trainer twice.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions that pass shared-memory tensors to the child

from spinwheel.engine.process import EngineCoreProcess, PipeCore
from spinwheel.models.config import ModelConfig
from spinwheel.models.lora import lora_layers
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.rl.llm.rollouts.weight_sync import state_bytes, sync_keys


class EngineDied(RuntimeError):
    """The engine process exited (or its pipe broke) during a call."""


@dataclass
class _Spec:
    """What the child builds its engine from."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]  # shared memory, written by the parent between two calls
    tokenizer: Tokenizer
    options: dict[str, Any]  # EngineConfig fields
    num_threads: int
    version: int
    kv: str
    wrap: tuple[type, type]  # (VersionedEngine, WeightBox) of async_rollouts, which imports this module
    lora: Any = None  # the policy's LoRAConfig: the child's model gets the same adapter layers (unmerged)
    sync_keys: tuple[str, ...] = ()  # what each update changes (weight_sync.sync_keys): the child reloads these

    def start(self, conn: Connection) -> tuple[RolloutCore, tuple[set[int], int]]:
        """In the child (:func:`~spinwheel.engine.process.serve_core`): the engine, versioned, and its core."""
        from spinwheel.engine import LLM
        from spinwheel.models.lora import apply_lora
        from spinwheel.models.transformer import Transformer

        versioned_engine, weight_box = self.wrap
        dtype = next(iter(self.weights.values())).dtype
        model = Transformer(self.config).to(dtype).requires_grad_(False)
        if self.lora is not None:
            apply_lora(model, self.lora, seed=0)  # the factors are loaded next
        model.load_state_dict(self.weights, strict=False)
        box = weight_box(self.version)
        box.state = {k: self.weights[k] for k in self.sync_keys}
        engine = versioned_engine(LLM(model, self.tokenizer, **self.options).engine, box, self.version, self.kv)
        return RolloutCore(engine, box, conn), (set(engine.eos_ids), engine.max_model_len)


class RolloutCore(PipeCore):
    """The child's core: each call of the producer is a command, answered at once, except ``step``, which the loop
    runs as its step (the producer decides when the engine steps: it plays the episodes); between calls it waits
    for the next command, and ends when the pipe closes."""

    def __init__(self, engine: Any, box: Any, conn: Connection) -> None:
        super().__init__(engine, conn)
        self.box = box
        self.stream: bool | None = None  # the step asked for (its ``stream``), not run yet

    def has_work(self) -> bool:
        return self.stream is not None

    def apply(self, commands: Iterator[tuple]) -> None:
        for command in commands:
            name, args = command[0], command[1:]
            if name == "shutdown":
                self.stopped = True
                return
            if name == "step":
                version, self.stream = args
                self.box.version = max(self.box.version, version)
                continue
            try:
                value = getattr(self.engine, name)(*args)
            except Exception as e:  # noqa: BLE001 - the parent raises it in the producer
                self.step_failed(e)
                continue
            self.send(("ok", value))

    def step(self) -> tuple:
        stream, self.stream = self.stream, None
        outputs = self.engine.step(stream)
        engine, bm = self.engine, self.engine.block_manager
        return outputs, (engine.num_prompt_tokens, bm.num_prefix_hit_tokens, engine.num_swaps, engine.num_recomputed)

    def deliver(self, outputs: tuple, step_s: float) -> None:
        self.send(("ok", outputs))

    def step_failed(self, error: Exception) -> None:
        """A call failed: the parent raises it in the producer."""
        self.stream = None
        self.send(("error", RuntimeError(f"the rollout engine process failed: {type(error).__name__}: {error}")))


class EngineProcess:
    """The producer's engine, stepping in a child process (module docstring). Stands in for a
    :class:`~spinwheel.rl.llm.rollouts.async_rollouts.VersionedEngine` once :meth:`versioned` gives it the weight
    box."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Tokenizer, options: dict[str, Any], version: int, kv: str,
        num_threads: int, timeout_s: float, wrap: tuple[type, type],
    ) -> None:  # fmt: skip
        self.model, self.tokenizer, self.options, self.kv, self.wrap = model, tokenizer, options, kv, wrap
        self.num_threads, self.timeout_s = num_threads, timeout_s
        with torch.no_grad():
            self.weights = {
                k: v.detach().clone().share_memory_()
                for k, v in model.state_dict().items()
                if not k.startswith("rotary.")
            }
        self.weight_bytes = sum(w.numel() * w.element_size() for w in self.weights.values())
        layers = lora_layers(model)  # with LoRA an update copies the adapters alone (weight_sync.sync_state)
        self.lora, self.sync_keys = next(iter(layers.values())).config if layers else None, tuple(sync_keys(model))
        self.version, self.box = version, None
        self.num_swaps = self.num_recomputed = self.num_prompt_tokens = self.restarts = 0
        self.block_manager = SimpleNamespace(num_prefix_hit_tokens=0)
        self.publish_s, self.published_bytes, self.load_s, self._before = 0.0, 0, 0.0, (0, 0)
        self.process: EngineCoreProcess | None = None
        self.dead = True
        self._start()

    def versioned(self, box: Any, version: int, kv: str) -> EngineProcess:
        self.box = box
        return self

    # ---- the child ----
    @property
    def proc(self) -> Any:
        """The child's ``multiprocessing`` process."""
        return self.process.proc

    def _start(self) -> None:
        from spinwheel.parallel.launch import rank_context

        spec = _Spec(
            self.model.config,
            self.weights,
            self.tokenizer,
            self.options,
            self.num_threads,
            self.version,
            self.kv,
            self.wrap,
            self.lora,
            self.sync_keys,
        )
        try:
            process = EngineCoreProcess(rank_context(), spec, self.timeout_s, name="rollout-engine")
        except RuntimeError as e:  # it died or failed while starting: the producer may start another
            raise EngineDied(f"the rollout engine process could not start: {e}") from None
        replies: queue.SimpleQueue = queue.SimpleQueue()  # one per child: a dead one's end never reaches the next
        process.serve(replies.put, lambda failure: replies.put(("died", failure)))
        self.process, self.replies, self.dead = process, replies, False
        self.eos_ids, self.max_model_len = process.info

    def restart(self) -> None:
        """A new child on the newest weights copied to shared memory (after :class:`EngineDied`)."""
        self.kill()
        self.restarts += 1
        self._before = (self.num_swaps, self.num_recomputed)  # the new child counts from 0
        self._start()

    def kill(self) -> None:
        if self.process is not None:
            self.process.close()
        self.dead = True

    def _call(self, name: str, *args: Any) -> Any:
        """Send one call and wait for its answer (at most ``timeout_s``)."""
        if self.dead:
            raise EngineDied("the rollout engine process is gone")
        self.process.post((name, *args))
        try:
            status, value = self.replies.get(timeout=self.timeout_s)
        except queue.Empty:
            self.kill()
            raise TimeoutError(
                f"the rollout engine process gave no answer to '{name}' in {self.timeout_s:g} s (--timeout-s): "
                "it hangs; the run stops"
            ) from None
        if status == "died":
            self.kill()
            raise EngineDied(f"the rollout engine process died (exit code {self.process.exitcode})")
        if status == "error":
            raise value
        return value

    # ---- the engine's calls the episode driver makes ----
    def add_request(self, request_id: str, prompt: Any, params: Any = None, arrival_time: float | None = None) -> None:
        self._call("add_request", request_id, prompt, params, arrival_time)

    def step(self, stream: bool = True) -> list:
        if self.dead:  # the driver releasing its requests after EngineDied: nothing to step
            return []
        version, state = self.box.latest() if self.box is not None else (self.version, None)
        if version > self.version and state is not None:
            start = time.perf_counter()
            with torch.no_grad():
                for k, v in state.items():
                    self.weights[k].copy_(v)
            self.load_s = time.perf_counter() - start  # the last copy's seconds (weight_sync.engine_sync_figures)
            self.publish_s += self.load_s
            self.published_bytes += state_bytes(state)
            self.version = version
        outputs, (prompt_tokens, hits, swaps, recomputed) = self._call("step", self.version, stream)
        self.num_prompt_tokens, self.block_manager.num_prefix_hit_tokens = prompt_tokens, hits
        self.num_swaps, self.num_recomputed = self._before[0] + swaps, self._before[1] + recomputed
        return outputs

    def abort(self, request_id: str) -> bool:
        return False if self.dead else self._call("abort", request_id)

    def stop_sample(self, request_id: str, index: int, stop_reason: str) -> None:
        self._call("stop_sample", request_id, index, stop_reason)

    def token_versions(self, request_id: str, index: int, num_tokens: int) -> list[int]:
        return self._call("token_versions", request_id, index, num_tokens)

    def forget(self) -> None:
        self._call("forget")
