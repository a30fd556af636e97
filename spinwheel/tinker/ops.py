"""What each Tinker request does, as :class:`TinkerService` methods; the HTTP layer (:mod:`~spinwheel.tinker.app`)
only decodes requests and answers with futures.

Model ids are ``SESSION:train:SEQ`` (the id the SDK itself derives for a client created from saved state), sampling
session ids ``SESSION:sample:SEQ``. Every method that touches the model is queued on the
:class:`~spinwheel.tinker.service.Worker`, in its training client's order.
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

from spinwheel.engine.llm_engine import LLMEngine
from spinwheel.models.lora import LoRAConfig
from spinwheel.models.transformer import Transformer
from spinwheel.tinker import checkpoints
from spinwheel.tinker.adapters import targets_for
from spinwheel.tinker.futures import FutureStore
from spinwheel.tinker.losses import LossInputError
from spinwheel.tinker.optim import AdamHP
from spinwheel.tinker.sampler import Sampler, SamplingSession
from spinwheel.tinker.service import Job, Worker
from spinwheel.tinker.trainer import Trainer
from spinwheel.tinker.wire import FwdBwdRequest


class TinkerService:
    def __init__(
        self,
        model: Transformer,
        engine: LLMEngine,
        trainer: Trainer,
        names: list[str],
        tokenizer_dir: Path,
        run_dir: Path,
        lora_alpha: float,
        gather_ms: float = 0.0,
    ) -> None:
        self.model, self.engine, self.trainer = model, engine, trainer
        self.names = names  # names[0] is the one the service reports; any of them may be asked for
        self.tokenizer_dir, self.run_dir, self.lora_alpha = tokenizer_dir, run_dir, lora_alpha
        self.store = FutureStore()
        self.sampler = Sampler(engine)
        self.worker = Worker(trainer, self.sampler, self.store, gather_ms)
        self._session_ids = itertools.count()
        self._sampler_names = itertools.count()

    # ---- sessions and metadata (answered at once) ----
    def create_session(self) -> str:
        return f"s{next(self._session_ids)}-{uuid.uuid4().hex[:8]}"

    def check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in self.names:
            raise LossInputError(f"base_model '{base_model}' is not served here: this service serves {self.names[0]}")

    def capabilities(self) -> dict:
        ctx = self.model.config.max_position_embeddings
        return {
            "supported_models": [
                {"model_name": self.names[0], "max_context_length": ctx, "trainable": True, "sampleable": True}
            ]
        }

    def info(self, model_id: str) -> dict:
        client = self.trainer.client(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_name": self.names[0],
            "is_lora": True,
            "lora_rank": client.config.rank,
            "model_data": {
                "arch": self.model.config.model_type,
                "model_name": self.names[0],
                "tokenizer_id": str(self.tokenizer_dir),
            },
        }

    # ---- queued on the worker ----
    def submit(self, model_id: str | None, **job: Any) -> str:
        return self.worker.submit(model_id, Job(self.store.create(), **job))

    def create_model(self, session_id: str, seq: int, base_model: str, lora: dict, seed: int | None) -> str:
        self.check_base(base_model)
        model_id = f"{session_id}:train:{seq}"
        config = LoRAConfig(
            rank=int(lora.get("rank", 32)),
            alpha=self.lora_alpha,
            targets=targets_for(bool(lora.get("train_attn", True)), bool(lora.get("train_mlp", True))),
            base_model_name_or_path=self.names[0],
        )

        def run() -> dict:
            self.trainer.create(model_id, config, seed)
            return {"type": "create_model", "model_id": model_id}

        return self.submit(model_id, call=run)

    def forward_backward(self, req: FwdBwdRequest) -> str:
        return self.submit(req.model_id, fwdbwd=req)

    def optim_step(self, model_id: str, adam: dict) -> str:
        if adam.get("type", "adamw") not in ("adamw", "adam"):
            raise LossInputError(f"optimizer '{adam.get('type')}' is not implemented here: use AdamParams")
        hp = AdamHP(
            lr=float(adam.get("learning_rate", 1e-4)),
            beta1=float(adam.get("beta1", 0.9)),
            beta2=float(adam.get("beta2", 0.95)),
            eps=float(adam.get("eps", 1e-12)),
            weight_decay=float(adam.get("weight_decay", 0.0)),
            grad_clip_norm=float(adam.get("grad_clip_norm", 0.0)),
        )
        return self.submit(model_id, optim=(model_id, hp))

    def save(self, model_id: str, name: str | None, kind: str, optimizer: bool) -> str:
        def run() -> dict:
            client = self.trainer.client(model_id)
            label = name if name is not None else f"sampler-{next(self._sampler_names)}"
            path = checkpoints.save(self.run_dir, client, self.model, self.names[0], kind, label, optimizer)
            if kind == "weights":
                return {"type": "save_weights", "path": path}
            session = None
            if name is None:  # save_weights_and_get_sampling_client: a sampling session on these weights
                session = self._open_sampler(f"{model_id.split(':')[0]}", path)
            return {"type": "save_weights_for_sampler", "path": path, "sampling_session_id": session}

        return self.submit(model_id, call=run)

    def load(self, model_id: str, path: str, optimizer: bool, create: tuple | None) -> str:
        """Load saved state onto ``model_id`` (``create``: (base_model, seed) to create the client first, sized by
        the checkpoint's adapter config)."""

        def run() -> dict:
            config, tensors, state = checkpoints.read(self.run_dir, self.model, path)
            if optimizer and state is None:
                raise checkpoints.CheckpointPathError(f"'{path}' holds no optimizer state: save it with save_state")
            if create is not None:
                self.check_base(create[0])
                config.base_model_name_or_path = self.names[0]
                self.trainer.create(model_id, config, create[1])
            checkpoints.restore(self.trainer.client(model_id), tensors, state if optimizer else None, path)
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return self.submit(model_id, call=run)

    def sample(self, session_id: str, req: dict) -> str:
        return self.submit(None, sample=(session_id, req))

    # ---- sampling sessions ----
    def _open_sampler(self, session_id: str, model_path: str | None) -> str:
        sid = f"{session_id}:sample:{uuid.uuid4().hex[:8]}"
        adapter = None
        if model_path is not None:
            local, _, _ = checkpoints.local_dir(self.run_dir, model_path)
            if not (local / checkpoints.ADAPTER_CONFIG).is_file():
                raise checkpoints.CheckpointPathError(f"'{model_path}': no saved weights there")
            adapter = self.sampler.serve_adapter(model_path, local)
        self.sampler.sessions[sid] = SamplingSession(adapter, model_path)
        return sid

    def create_sampling_session(self, session_id: str, model_path: str | None, base_model: str | None) -> str:
        """A sampling session now (it registers the adapter on the worker, between model steps)."""
        self.check_base(base_model)
        done: dict = {}

        def run() -> dict:
            done["sid"] = self._open_sampler(session_id, model_path)
            return done

        job = Job(self.store.create(), call=run)
        self.worker.submit(f"sampler:{session_id}", job)
        outcome = self.store.poll(job.rid, 600)
        if outcome is None or outcome.error is not None:
            raise LossInputError(outcome.error if outcome else "the service did not open the sampling session")
        return done["sid"]

    def sampler_info(self, sid: str) -> dict:
        session = self.sampler.sessions.get(sid)
        if session is None:
            raise LossInputError(f"no sampling session '{sid}' in this service")
        return {"sampler_id": sid, "base_model": self.names[0], "model_path": session.model_path}

    def close(self) -> None:
        self.worker.close()
