"""A tensor-parallel rank of the engine: its shard of the model, its shard of the KV cache, and the step it runs.

Every rank (the driver, rank 0, and the workers :mod:`~spinwheel.engine.parallel.tp_executor` spawns) holds the Megatron
split of :func:`spinwheel.parallel.tensor.apply_tensor_parallel`: q/k/v and gate/up column-parallel (its
``H/N`` query heads, ``G/N`` KV heads and ``I/N`` MLP features), ``o_proj`` and ``down_proj`` row-parallel (one
all-reduce of the (N_tokens, C) activation each), the embedding and the LM head vocab-parallel. Its config says
``H/N`` and ``G/N`` heads, so the :class:`~spinwheel.engine.model_runner.ModelRunner` it runs under allocates
``G/N`` heads of every KV block: each rank holds 1/N of every block, and the pool has as many blocks as one device
would (:func:`pool_sizes`), so the driver's block manager schedules exactly what one device would.

A step is the same on every rank (:meth:`TPModelRunner.execute`): the block moves of the schedule, then the forward
over the inputs the driver prepared, then the LM head on the sampled rows; the vocab slices of the logits are
all-gathered, so the driver samples from the whole (R, V) logits as on one device. LoRA adapters added on the driver
travel with the next step (``Step.adapters``) and each rank serves its shard's slice
(:mod:`~spinwheel.engine.multi_lora`). New weights (``LLM.update_weights``) come as a message of their own, each
rank's slices only, acknowledged once loaded (:mod:`~spinwheel.engine.parallel.tp_update`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.model_runner import ModelRunner, StepInputs, StepLogits
from spinwheel.engine.multi_lora import AdapterRegistry, AdapterShipment, Shard
from spinwheel.engine.parallel.tp_update import receive_slices
from spinwheel.models.config import ModelConfig
from spinwheel.models.transformer import RotaryEmbedding, Transformer
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.tensor import apply_tensor_parallel

logger = logging.getLogger(__name__)


def check_tp_degree(config: ModelConfig, tp: int) -> None:
    """Refuse a TP degree the model cannot be split by (one line, before anything is allocated)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    parts = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    bad = [f"{name} ({n})" for name, n in parts.items() if n % tp]
    if bad:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {' and '.join(bad)}")


def checkpoint_config(path_or_preset: str | os.PathLike) -> ModelConfig | None:
    """A checkpoint's ``config.json`` or a preset's config (for the built-in tokenizer), read before any weight is,
    so that a bad engine degree fails first; None for anything else (loading it then says what is wrong)."""
    from spinwheel.models.hf import load_config
    from spinwheel.models.hub import resolve_model_path
    from spinwheel.models.presets import PRESETS, preset_config
    from spinwheel.models.tokenizer import Tokenizer

    path = Path(resolve_model_path(path_or_preset))
    if (path / "config.json").is_file():
        return load_config(path)
    if str(path_or_preset) in PRESETS and not path.exists():
        return preset_config(str(path_or_preset), Tokenizer.char_level().vocab_size)
    return None


def check_checkpoint_tp_degree(path_or_preset: str | os.PathLike, tp: int) -> None:
    """:func:`check_tp_degree` on :func:`checkpoint_config`, before any weight is read."""
    if (config := checkpoint_config(path_or_preset)) is not None:
        check_tp_degree(config, tp)


@dataclass
class Step:
    """What the driver sends every other rank per step, tensor-parallel worker or pipeline stage alike (vLLM's
    ``ExecuteModelRequest``): the schedule's block moves and the flat batch the driver prepared (tensors on CPU;
    None when the step only moves blocks), or ``stop``; and the LoRA adapters added on the driver since the last
    step (a stage: its layers' part), which the rank installs before the step's forward. ``weights`` carries an
    update: for a tensor-parallel worker the names, shapes and dtypes of its slices of new weights, whose bytes
    follow as raw messages (an update, not a step: the worker reads them into its shard and acknowledges,
    :mod:`~spinwheel.engine.parallel.tp_update`); for a stage its part's tensors, loaded before the step
    (:mod:`~spinwheel.engine.parallel.pp_lora`)."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copy: list[tuple[int, int]]
    inputs: StepInputs | None
    stop: bool = False
    adapters: list[AdapterShipment] = dataclasses.field(default_factory=list)
    weights: list[tuple[str, tuple[int, ...], torch.dtype]] | dict[str, torch.Tensor] | None = None


def to_device(obj, device: torch.device):
    """``obj`` with every tensor inside (lists, tuples, dicts, dataclasses) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = dataclasses.replace(obj) if all(f.init for f in dataclasses.fields(obj)) else obj
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, to_device(getattr(obj, f.name), device))
        return new
    return obj


def shard_model(
    config: ModelConfig, state: dict[str, torch.Tensor], axis: Axis, comm: Comm, device: torch.device
) -> Transformer:
    """This rank's shard of the model whose full weights are ``state``: built on the meta device (no full copy),
    the weights assigned by reference, then split by :func:`apply_tensor_parallel` (which copies only this rank's
    slices) and moved to ``device``. Its config names the local head counts, which size the KV cache."""
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, assign=True, strict=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config)
    apply_tensor_parallel(model, axis, comm)
    model.to(device)
    n = axis.size
    model.config = dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=config.num_key_value_heads // n,  # type: ignore[operator]
        head_dim=config.head_dim,
    )
    return model.eval()


def full_config(local: ModelConfig, tp: int) -> ModelConfig:
    """The whole model's config from a rank's (whose head counts are 1/tp of the model's: :func:`shard_model`)."""
    return dataclasses.replace(
        local,
        num_attention_heads=local.num_attention_heads * tp,
        num_key_value_heads=local.num_key_value_heads * tp,  # type: ignore[operator]
    )


def pool_sizes(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int) -> EngineConfig:
    """``config`` with the block counts one device would get (ModelRunner's rules on the full model's block size),
    so a rank's pool holds as many blocks as one device's, each 1/N of the size."""
    elem = torch.empty((), dtype=dtype).element_size()
    full_block = 2 * model_config.num_hidden_layers * config.block_size * model_config.num_key_value_heads * elem
    full_block *= model_config.head_dim  # type: ignore[operator]
    blocks, _ = config.kv_pool_blocks(full_block, max_model_len)
    cpu = config.num_cpu_blocks
    if cpu is None:
        cpu = 0 if config.preemption_mode != "swap" else min(blocks, int(config.swap_space_mb * 2**20 // full_block))
    return dataclasses.replace(config, num_kv_blocks=blocks, num_cpu_blocks=cpu, cpu_packed_weights=False)


class TPModelRunner(ModelRunner):
    """A :class:`ModelRunner` over a model shard: the same step on every rank, the logits gathered over the TP axis.

    On the driver a :class:`~spinwheel.engine.executor.ShardedExecutor` ships each step to the other ranks before
    it runs here (:meth:`execute`), as they run it on theirs."""

    def __init__(self, model: Transformer, config: EngineConfig, max_model_len: int, axis: Axis, comm: Comm) -> None:
        super().__init__(model, config, max_model_len)
        self.axis, self.comm = axis, comm
        shard = Shard(full_config(model.config, axis.size), axis=axis)
        self.loras = AdapterRegistry(model, shard)  # each rank's slice of every adapter (multi_lora)

    @torch.inference_mode()
    def execute(self, step: Step) -> StepLogits | None:
        """One step on this rank's shard (the same on every rank): adapters the driver added, block moves, forward,
        gathered logits."""
        for shipment in step.adapters:
            self.loras.receive(shipment)
        if step.swap_out or step.swap_in or step.copy:
            self.move_blocks(
                SimpleNamespace(
                    blocks_to_swap_out=step.swap_out, blocks_to_swap_in=step.swap_in, blocks_to_copy=step.copy
                )
            )  # type: ignore[arg-type]
        if step.inputs is None:
            return None
        inputs = step.inputs
        if self.model.device.type != "cpu":
            inputs = to_device(inputs, self.model.device)
        return self.select_rows(self.forward(inputs), inputs)

    @torch.inference_mode()
    def select_rows(self, hidden: torch.Tensor, inputs: StepInputs) -> StepLogits:
        """This rank's vocabulary slice of the picked rows' logits (R, V/N), all-gathered to (R, V)."""
        if len(inputs.picks) != hidden.shape[0]:
            hidden = hidden[torch.tensor(inputs.picks, dtype=torch.long, device=hidden.device)]
        local = self.model.lm_head(hidden).float().contiguous()
        logits = torch.cat(self.comm.all_gather_list(local, self.axis), dim=-1)
        return StepLogits(logits, inputs.sample_rows, inputs.prompt_rows)

    def shard_bytes(self) -> dict[str, int]:
        """This rank's memory: weights (sharded and replicated) and KV cache, in bytes."""
        sharded = replicated = 0
        seen: set[int] = set()
        for name, p in self.model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            size = p.numel() * p.element_size()
            if name.endswith(("norm.weight", "o_proj.bias", "down_proj.bias")):
                replicated += size
            else:
                sharded += size
        return {"sharded_weights": sharded, "replicated_weights": replicated, "kv_cache": self.kv_cache_bytes}


def worker_main(
    rank: int,
    world: int,
    init_method: str,
    backend: str,
    timeout_s: float,
    conn,
    model_config,
    box: list[dict[str, torch.Tensor]],
    engine_config,
    max_model_len: int,
) -> None:
    """A worker process: join the TP group, build this rank's shard and runner, then run each step the driver
    sends through ``conn`` until ``stop`` or until the driver is gone (its end of the pipe closed); a weight update
    is loaded and acknowledged (the number of elements written)."""
    import torch.distributed as dist

    from spinwheel.engine.parallel.workers import driver_steps, join_engine_group

    flush = engine_config.flush_denormal
    device = join_engine_group(rank, world, init_method, backend, backend == "nccl", timeout_s, flush, conn)
    try:
        axis, comm = Axis("tp", tuple(range(world)), rank, dist.group.WORLD), Comm(timeout_s)
        runner = TPModelRunner(
            shard_model(model_config, box.pop(), axis, comm, device), engine_config, max_model_len, axis, comm
        )
        conn.send(runner.shard_bytes())
        for step in driver_steps(conn):
            if step.weights is not None:
                conn.send(receive_slices(conn, runner.model, step.weights))
            else:
                runner.execute(step)
    finally:
        dist.destroy_process_group()
