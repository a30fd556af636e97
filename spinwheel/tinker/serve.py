"""``spinwheel tinker``: the Tinker training API over one frozen base model, for the official ``tinker`` SDK.

One process loads the base once; training clients are LoRA adapters with their own AdamW state on it, sampling
runs in the engine over the same modules. A Tinker user points the SDK at it::

    export TINKER_API_KEY=tml-local            # any key with the tml- prefix: the service does not check it
    service = tinker.ServiceClient(base_url="http://127.0.0.1:8000")
    client = service.create_lora_training_client(base_model="smollm2-135m-instruct", rank=8)

The SDK loads the tokenizer with ``transformers.AutoTokenizer`` from ``get_info``'s ``tokenizer_id``: the service
writes the model's tokenizer into ``RUN_DIR/tokenizer`` and names that directory, so no Hub download happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spinwheel.config import option
from spinwheel.server.background import UvicornThread


@dataclass
class TinkerConfig:
    """Serve the Tinker training API (the official `tinker` SDK's routes) over one base model."""

    model: str | None = option(None, help="base model: checkpoint directory, Hub id, GGUF, named model or preset")
    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, help="port to listen on")
    run_dir: str = option("tinker-run", help="directory for saved state (tinker:// paths) and the tokenizer")
    model_name: str | None = option(None, help="the name clients give as base_model (default: --model as given)")
    lora_alpha: float = option(32.0, help="LoRA alpha of every training client (scaling alpha / rank)")
    dtype: str | None = option(None, help="model dtype: float32, bfloat16 (default: the checkpoint's)")
    device: str | None = option(None, help="cpu or cuda (default: cuda when available)")
    micro_batch_tokens: int = option(8192, help="padded tokens per forward/backward micro-batch")
    kv_cache_memory_mb: float = option(256.0, help="the sampling engine's KV-cache memory")
    gather_ms: float = option(
        0.0, help="longest a forward_backward batch waits for clients between two steps to join it (0: never)"
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("give --model (a checkpoint directory, Hub id, GGUF file, named model or preset)")
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError(f"--port {self.port}: give a port in 1..65535")
        if self.gather_ms < 0:
            raise ValueError(f"--gather-ms {self.gather_ms}: give 0 (no waiting) or more")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"--micro-batch-tokens {self.micro_batch_tokens}: give at least 1")


def build_service(config: TinkerConfig):
    """Load the base and build the service (model, engine, trainer, worker)."""
    import torch

    from spinwheel.engine.config import EngineConfig
    from spinwheel.engine.llm_engine import LLMEngine
    from spinwheel.models import load_model, load_tokenizer
    from spinwheel.models.hub import resolve_model_path
    from spinwheel.tinker.adapters import install
    from spinwheel.tinker.ops import TinkerService
    from spinwheel.tinker.trainer import Trainer

    assert config.model is not None
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(config.model, dtype=config.dtype, device=device).eval()
    tokenizer = load_tokenizer(config.model)
    run_dir = Path(config.run_dir).resolve()
    tokenizer.save_pretrained(run_dir / "tokenizer")
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory_mb=config.kv_cache_memory_mb, device=device))
    train_rows = install(model, engine.loras)
    trainer = Trainer(model, train_rows, config.micro_batch_tokens)
    names = [config.model_name or config.model, config.model, str(resolve_model_path(config.model))]
    return TinkerService(
        model,
        engine,
        trainer,
        list(dict.fromkeys(names)),
        run_dir / "tokenizer",
        run_dir,
        config.lora_alpha,
        config.gather_ms,
    )


class BackgroundTinker(UvicornThread):
    """The service on a free loopback port in a background thread (tests, benchmarks)."""

    what = "tinker service"

    def __init__(self, service, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from spinwheel.tinker.app import build_app

        super().__init__(host, port)
        self.service = service
        self.serve(uvicorn.Config(build_app(service), host=self.host, port=self.port, log_level="warning"))

    def stopped(self) -> None:
        self.service.close()


def run_tinker(config: TinkerConfig) -> int:
    import uvicorn

    from spinwheel.tinker.app import build_app

    service = build_service(config)
    print(
        f"spinwheel tinker: {service.names[0]} on http://{config.host}:{config.port} (state in {service.run_dir}); "
        f"clients: TINKER_API_KEY=tml-local, ServiceClient(base_url=...)",
        flush=True,
    )
    try:
        uvicorn.run(build_app(service), host=config.host, port=config.port, log_level="warning")
    finally:
        service.close()
    return 0
