"""LoRA in the training runs (``--lora-rank`` on ``sft``, ``dpo``, ``rm`` and the RL commands): what a run starts
from, its reference policy and what a weight sync moves.

* **The model.** The base is always ``--model``; a new run puts fresh adapters on it (:func:`~spinwheel.models.lora.
  apply_lora`, seeded by ``--seed``), a resumed run the checkpoint's (a PEFT adapter directory; a reward model's
  adapters and score head travel in its trainer state, see :func:`lora_head_state`). The base is frozen, so the
  learner's AdamW holds state for the adapters alone. ``--model`` may be a PEFT adapter directory (an SFT run's
  LoRA checkpoint): the base it names is loaded with that adapter folded in (:func:`~spinwheel.models.hf.load_model`),
  and a LoRA run trains new adapters on that merged model, whose files name the adapter directory as their base —
  TRL's recommended way from an SFT adapter to DPO or RL, and the one where "adapters off" (the reference) is the
  SFT model the run started from. Without ``--lora-rank`` the merged model is trained whole.
* **The reference.** DPO and RL with β > 0 compare the policy with the model it started from. Under LoRA that is
  the base with the adapters switched off (:func:`~spinwheel.models.lora.adapters_disabled`): :class:`AdaptersOff`
  runs the policy learner's own forward that way, so no second copy of the model is loaded.
* **Weight sync.** In one process the engine serves the learner's model object, adapters included (unmerged:
  the engine's forward is the model's, each wrapped projection adds its ``B A x``), so an update reaches the
  engine without a copy. :func:`sync_figures` says what a sync to an engine holding its own copy would move:
  the adapters (``lora_sync_mb``) against every weight (``full_sync_mb``).
* **Layouts.** Under ``torchrun`` LoRA runs with DDP and ZeRO-1/2, whose buckets and shards then hold the adapters
  alone (they take the trainable parameters; the frozen base gets no gradient and no optimizer state), and with
  tensor parallelism, which splits each factor as its base layer splits (:mod:`~spinwheel.parallel.tensor_lora`);
  and with pipelines (each stage its blocks' adapters); sharded checkpoints keep only trained parameters and rank 0
  writes the gathered PEFT adapter, as one process does. ZeRO-3 / FSDP / HSDP (flat units mix frozen and trained
  weights) are refused in one line (:func:`check_one_process`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from spinwheel.models.hf import load_model
from spinwheel.models.lora import adapters_disabled, apply_lora, lora_layers, lora_parameters
from spinwheel.models.lora_io import load_adapter
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.io.lazy_load import load_figures
from spinwheel.train.learners import Learner

if TYPE_CHECKING:
    from spinwheel.train.run import Run
    from spinwheel.train.run_config import RunConfig

LORA_HEAD_STATE = "lora_head_state"  # trainer-state key of a scalar-head model's adapters and head


def check_one_process(config: RunConfig, distributed: bool, command: str) -> None:
    """Refuse ``--lora-rank`` under a torchrun layout it does not run on (one line): it runs in one process and
    under DDP, ZeRO-1/2, tensor and pipeline parallelism (and their products), not under the fully sharded
    layouts."""
    if not (distributed and config.lora_rank):
        return
    p = config.parallel
    flags = {"--zero 3": p.zero == 3, "--fsdp": p.fsdp and not p.hsdp, f"--hsdp {p.hsdp}": p.hsdp}
    if refused := [flag for flag, on in flags.items() if on]:
        raise ValueError(
            f"spinwheel {command} --lora-rank runs under DDP (--zero 0), --zero 1, --zero 2, --tp and --pp, not "
            f"{' '.join(refused)} (flat units mix frozen and trained weights): --zero 1/2 shard all the adapters' "
            "optimizer state"
        )


def load_run_model(config: RunConfig, run: Run, **load: Any) -> Transformer:
    """The LM a run trains: ``--model``, or the checkpoint it resumes from. With ``--lora-rank`` the base is always
    ``--model`` (a LoRA checkpoint holds only the adapters), under fresh adapters or the checkpoint's. ``load`` goes
    to :func:`~spinwheel.models.hf.load_model`; its ``lazy`` (a learner under torchrun) holds without LoRA."""
    lora = config.lora_config()
    load["lazy"] = load.get("lazy", False) and lora is None  # LoRA: adapters are drawn on a materialised base
    model = load_model(run.ckpt_dir if run.resumed and lora is None else config.model, **load)
    if lora is not None and run.resumed:
        load_adapter(model, run.ckpt_dir)
    elif lora is not None:
        apply_lora(model, lora, seed=config.seed)
    return model


def adapt_scalar_head(model: Transformer, config: RunConfig, state: dict[str, Any] | None) -> Transformer:
    """A scalar-head model (reward model) under ``--lora-rank``: adapters on the body, the score head trained
    whole (PEFT's ``modules_to_save`` for sequence classifiers); resumed from ``state``'s :data:`LORA_HEAD_STATE`."""
    lora = config.lora_config()
    if lora is None:
        return model
    apply_lora(model, lora, seed=config.seed)
    model.lm_head.weight.requires_grad_(True)
    if state is not None and LORA_HEAD_STATE in state:  # absent under TP: the sharded state restores them
        saved = state[LORA_HEAD_STATE]
        with torch.no_grad():
            for name, p in lora_head_parameters(model).items():
                p.copy_(saved[name])
    return model


def lora_head_parameters(model: Transformer) -> dict[str, torch.nn.Parameter]:
    """What a scalar-head LoRA model trains: the adapters and the score head."""
    return {**lora_parameters(model), "lm_head.weight": model.lm_head.weight}


def lora_head_state(model: Transformer) -> dict[str, dict[str, torch.Tensor]]:
    """The trainer-state entry that resumes a scalar-head LoRA model exactly (its checkpoint's HF files hold the
    merged weights, which cannot be split again); empty for any other model."""
    if not lora_layers(model) or model.config.num_labels is None:
        return {}
    return {LORA_HEAD_STATE: {n: p.detach().cpu().clone() for n, p in lora_head_parameters(model).items()}}


class AdaptersOff:
    """The reference policy of a LoRA run: the forward of ``learner`` (training ``model``) with every adapter of
    ``model`` switched off, i.e. the frozen base: the ``forward(batch)`` of a frozen learner on a separate copy of
    the base, with its outputs."""

    def __init__(self, learner: Learner, model: nn.Module) -> None:
        self.learner, self.model = learner, model
        self.is_main, self.distributed = learner.is_main, learner.distributed

    def forward(self, batch: dict[str, torch.Tensor], *, entropy: bool = False) -> dict[str, torch.Tensor]:
        with adapters_disabled(self.model):
            return self.learner.forward(batch, entropy=entropy)


def start_figures(model: Transformer) -> dict[str, float]:
    """What a run logs at step 0 about its model: :func:`sync_figures` and, for a lazily loaded one, the load's peak
    (:func:`~spinwheel.parallel.io.lazy_load.load_figures`: ``load_peak_mb`` against ``model_mb``)."""
    return {**sync_figures(model), **load_figures(model)}


def sync_figures(model: Transformer) -> dict[str, float]:
    """MiB a weight sync moves per update: ``full_sync_mb`` every weight of the model (adapters merged in), and
    with adapters ``lora_sync_mb`` the adapters alone (what an adapter-only sync sends)."""
    adapters = {id(p) for p in lora_parameters(model).values()}
    params = {id(p): p for p in model.parameters()}
    full = sum(p.numel() * p.element_size() for i, p in params.items() if i not in adapters)
    figures = {"full_sync_mb": full / 2**20}
    if adapters:
        figures["lora_sync_mb"] = sum(params[i].numel() * params[i].element_size() for i in adapters) / 2**20
    return figures
