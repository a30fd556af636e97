"""A pipeline-parallel stage of the engine: its contiguous slice of the layers, their KV cache, and the step it runs.

With ``EngineConfig.pipeline_parallel_size = P`` the model's L layers are cut into P stages of L/P layers (Orca's
inter-layer parallelism). Stage 0 (the driver, :mod:`~spinwheel.engine.parallel.pp_executor`) holds the embedding, the
last
stage the final norm and the LM head; each holds only its own layers' weights (:func:`stage_state`) and the KV
blocks of its layers only: its :class:`StageModel`'s config says L/P layers, so the
:class:`~spinwheel.engine.model_runner.ModelRunner` it runs under allocates every block for those layers alone, and
the pool has as many blocks as one device's (:func:`stage_pool_config`), each 1/P of the size.

A step (:class:`~spinwheel.engine.parallel.tp_worker.Step`, the same message to every stage) carries the schedule's
block
moves and the flat batch the driver prepared; a stage moves its blocks, takes the hidden states (N, C) of the stage
before it (stage 0 embeds the tokens), runs its layers and hands them on; the last stage applies the norm and the LM
head to the picked rows and sends their logits (R, V) back to the driver, which samples.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace

import torch
from torch import nn

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.kernels import cpu_forward
from spinwheel.engine.model_runner import ModelRunner, StepInputs
from spinwheel.engine.multi_lora import AdapterRegistry, Shard
from spinwheel.engine.parallel.pp_lora import load_stage_weights
from spinwheel.engine.parallel.tp_worker import Step, checkpoint_config, pool_sizes
from spinwheel.models.config import ModelConfig
from spinwheel.models.transformer import Block, RMSNorm, RotaryEmbedding, run_blocks

logger = logging.getLogger(__name__)


def check_pp_degree(config: ModelConfig, pp: int) -> None:
    """Refuse a PP degree the layers cannot be cut by into equal, non-empty stages (one line, before anything is
    allocated)."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    layers = config.num_hidden_layers
    if layers % pp:
        raise ValueError(
            f"pipeline_parallel_size {pp} must divide the model's num_hidden_layers ({layers}) so every stage "
            "holds as many layers (and none is empty)"
        )


def check_checkpoint_pp_degree(path_or_preset: str | os.PathLike, pp: int) -> None:
    """:func:`check_pp_degree` on :func:`~spinwheel.engine.parallel.tp_worker.checkpoint_config`, before any weight is
    read."""
    if (config := checkpoint_config(path_or_preset)) is not None:
        check_pp_degree(config, pp)


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The global indices of the layers of ``stage``."""
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def full_state(model) -> dict[str, torch.Tensor]:
    """The whole model's tensors the stages are cut from (detached, by reference), the rotary frequencies included
    (a buffer ``state_dict`` leaves out)."""
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    state["rotary.inv_freq"] = model.rotary.inv_freq.detach()
    return state


def stage_state(state: dict[str, torch.Tensor], config: ModelConfig, pp: int, stage: int) -> dict[str, torch.Tensor]:
    """The tensors of ``stage`` out of the full ``state`` (by reference; a weight update's may be part of the
    model's), its layers renumbered from 0: the embedding on the first stage, the final norm and the LM head on the
    last (a tied head: the embedding's tensor, which the last stage then holds as well); every stage gets
    ``rotary.inv_freq`` when ``state`` has it (the model's own, whatever its dtype, so every stage rotates exactly as
    the model does)."""
    layers, last = stage_layers(config.num_hidden_layers, pp, stage), stage == pp - 1
    out = {}
    for name, t in state.items():
        head, _, rest = name.partition(".")
        if head == "layers":
            index, _, rest = rest.partition(".")
            if int(index) in layers:
                out[f"layers.{int(index) - layers.start}.{rest}"] = t
        elif head == "rotary" or (head == "embed_tokens" and stage == 0) or (head in ("norm", "lm_head") and last):
            out[name] = t
    if last and "lm_head.weight" not in out and "embed_tokens.weight" in state and config.tie_word_embeddings:
        out["lm_head.weight"] = state["embed_tokens.weight"]  # tied and saved once (or a weight update's embedding)
    return out


class StageModel(nn.Module):
    """One stage's part of a :class:`~spinwheel.models.transformer.Transformer`, under the same parameter names
    (layers renumbered from 0): ``embed_tokens`` on the first stage, ``norm`` and ``lm_head`` on the last, None
    elsewhere. ``config`` counts this stage's layers (what the runner sizes the KV cache by); ``full_config`` is the
    model's."""

    def __init__(self, config: ModelConfig, pp: int, stage: int, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        layers = stage_layers(config.num_hidden_layers, pp, stage)
        self.full_config, self.stage, self.pp = config, stage, pp
        self.config = dataclasses.replace(config, num_hidden_layers=len(layers))
        self.first, self.last = stage == 0, stage == pp - 1
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if self.first else None
            self.layers = nn.ModuleList(Block(config, i) for i in layers)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.last else None
            self.lm_head = nn.Linear(config.hidden_size, config.num_outputs, bias=False) if self.last else None
        state = dict(state)
        inv_freq = state.pop("rotary.inv_freq", None)
        self.load_state_dict(state, assign=True, strict=True)
        self.rotary = RotaryEmbedding(config)
        if inv_freq is not None:
            self.rotary.inv_freq = inv_freq
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].self_attn.q_proj.weight.dtype

    def weight_bytes(self) -> dict[str, int]:
        """This stage's weights in bytes: its layers, and the edge parts (embedding, final norm, LM head)."""
        out = {"layer_weights": 0, "edge_weights": 0}
        seen: set[int] = set()
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                out["layer_weights" if name.startswith("layers.") else "edge_weights"] += p.numel() * p.element_size()
        return out


def stage_pool_config(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int):
    """``config`` for every stage's runner: one device's block counts (ModelRunner's rules on the full model),
    rounded down to a multiple of P so each of the P micro-batches owns an equal slice of the pool."""
    pp = config.pipeline_parallel_size
    sized = pool_sizes(config, model_config, dtype, max_model_len)
    blocks, cpu = sized.num_kv_blocks // pp, sized.num_cpu_blocks // pp  # type: ignore[operator]
    if blocks < 1:
        raise ValueError(f"the KV pool ({sized.num_kv_blocks} blocks) is smaller than pipeline_parallel_size {pp}")
    return dataclasses.replace(config, num_kv_blocks=blocks * pp, num_cpu_blocks=cpu * pp)


class StageRunner(ModelRunner):
    """A :class:`ModelRunner` over a :class:`StageModel`: block moves and the stage's part of the forward."""

    def __init__(self, model: StageModel, config: EngineConfig, max_model_len: int) -> None:
        super().__init__(model, dataclasses.replace(config, cpu_packed_weights=False), max_model_len)  # type: ignore
        layers = stage_layers(model.full_config.num_hidden_layers, model.pp, model.stage)
        self.loras = AdapterRegistry(model, Shard(model.full_config, layers))  # type: ignore[arg-type]
        if config.cpu_packed_weights and model.device.type == "cpu":
            cpu_forward.bound_primitive_caches(config.onednn_cache_capacity)
        if config.cpu_packed_weights and cpu_forward.supports(model):  # type: ignore[arg-type]
            self.packed = cpu_forward.PackedWeights(model)  # type: ignore[arg-type]

    def run(self, out):  # noqa: ANN001, ANN201 - LLMEngine's step: not how a pipeline runs
        raise RuntimeError(
            "an engine with pipeline_parallel_size > 1 is a PPEngine: build it with LLM(...) or "
            "spinwheel.engine.parallel.pp_engine.engine_class(config)"
        )

    def receive(self, step: Step) -> None:
        """What a message brings before its iteration: adapters the driver added, an update's weights."""
        for shipment in step.adapters:
            self.loras.receive(shipment)  # type: ignore[attr-defined]
        if step.weights is not None:
            load_stage_weights(self, step.weights)  # type: ignore[arg-type]

    def move(self, step: Step) -> None:
        if step.swap_out or step.swap_in or step.copy:
            moves = dict(blocks_to_swap_out=step.swap_out, blocks_to_swap_in=step.swap_in, blocks_to_copy=step.copy)
            self.move_blocks(SimpleNamespace(**moves))  # type: ignore[arg-type]

    @torch.inference_mode()
    def stage_forward(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's layers over the flat batch: from the tokens (stage 0) or the previous stage's ``hidden``
        (N, C); returns the hidden states (N, C) to hand on, normalised on the last stage. Each row goes through
        its adapter's factors of this stage's layers."""
        m = self.model
        with self.loras.active(inputs.lora_slots, m.device):
            if self.packed is not None:
                return self.packed_forward(inputs, hidden)
            x = m.embed_tokens(inputs.input_ids) if hidden is None else hidden  # type: ignore[misc]
            x = run_blocks(m.layers, m.rotary, x[None], inputs.positions[None], inputs.meta)[0]
            return m.norm(x) if m.norm is not None else x

    def memory(self) -> dict[str, int]:
        """This stage's memory in bytes: its layers' weights, the edge weights, its KV cache."""
        return {**self.model.weight_bytes(), "kv_cache": self.kv_cache_bytes}  # type: ignore[operator]
