"""Offline API: ``LLM(model_or_path).generate(prompts, SamplingParams(...))``.

``LLM`` accepts a checkpoint directory, a built-in preset name, or an in-memory :class:`Transformer` — the RL
trainers pass theirs, so the engine generates with the very weights being trained (``update_weights`` after each
optimiser step drops the prefix cache).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.executor import ExecutorFactory
from spinwheel.engine.executor_factory import make_executor
from spinwheel.engine.llm_engine import EngineStats
from spinwheel.engine.outputs import RequestOutput
from spinwheel.engine.parallel.pp_engine import engine_class
from spinwheel.engine.parallel.tp_worker import check_checkpoint_tp_degree
from spinwheel.engine.sampling_params import SamplingParams
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer


class LLM:
    def __init__(
        self,
        model_or_path: Transformer | str | os.PathLike,
        tokenizer: Tokenizer | None = None,
        executor: ExecutorFactory | None = None,
        **engine_config: Any,
    ) -> None:
        """``engine_config``: :class:`EngineConfig`'s fields; ``executor``: builds the engine's executor (default:
        the one the config asks for; :class:`~spinwheel.engine.llm_engine.LLMEngine`)."""
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_config) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; EngineConfig has {sorted(names)}")
        config = EngineConfig(**engine_config)
        if config.tensor_parallel_size > 1 and not isinstance(model_or_path, Transformer):
            check_checkpoint_tp_degree(model_or_path, config.tensor_parallel_size)  # before loading the weights
        engine = engine_class(config)  # the pipeline-parallel engine with pipeline_parallel_size > 1
        if isinstance(model_or_path, Transformer):
            self.engine = engine(model_or_path, tokenizer, config, executor=executor or make_executor)
        else:
            self.engine = engine.from_pretrained(model_or_path, config, tokenizer)
        self._counter = 0

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def model(self) -> Transformer:
        return self.engine.model

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, plist):
            rid = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, prompt, p)
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate")
        wanted = set(ids)
        while wanted - results.keys():
            for out in self.engine.step(stream=False):
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[r] for r in ids]

    def beam_search(
        self,
        prompts: str | list[str] | list[list[int]],
        beam_width: int = 4,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        ignore_eos: bool = False,
    ) -> list[RequestOutput]:
        """Beam search with Hugging Face ``generate(num_beams=beam_width)`` semantics; each output holds the
        ``beam_width`` best hypotheses, best first."""
        params = SamplingParams(
            n=beam_width,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            ignore_eos=ignore_eos,
        )
        return self.generate(prompts, params)

    def add_lora(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT adapter in ``path`` as ``name``: requests with ``SamplingParams(lora=name)`` run through it,
        unmerged, in the same batches as the base's and other adapters' (:mod:`~spinwheel.engine.multi_lora`)."""
        self.engine.add_lora(name, path)

    def update_weights(self, model_or_state_dict: Transformer | dict[str, torch.Tensor]) -> None:
        """New weights from the trainer (in process); invalidates the prefix cache. Under tensor parallelism the
        full weights are resharded: each rank gets its slices (:mod:`~spinwheel.engine.parallel.tp_update`)."""
        self.engine.update_weights(model_or_state_dict)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        """Give the model its original attention kernels back (the KV cache is released with the engine) and stop
        the executor's workers, if any."""
        self.engine.runner.uninstall()
        self.engine.executor.close()
