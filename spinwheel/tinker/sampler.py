"""The sampling side of the service: Tinker sampling sessions served by spinwheel's engine over the same base.

A sampling session names either the base model or saved sampler weights (``tinker://.../sampler_weights/NAME``); a
session on saved weights serves them as a LoRA adapter of the engine's multi-LoRA path
(:mod:`~spinwheel.engine.multi_lora`), registered once under its tinker:// path, unmerged, on the very modules the
training clients train through (no second copy of the base). Requests of every session run in the engine's batches
together. A Tinker ``SamplingParams`` maps onto the engine's: ``stop`` as strings or token ids (``[]``: not even
EOS stops), ``top_k`` -1 for none; every sampled token's log-probability comes back (Tinker always returns them),
and the prompt's with ``prompt_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spinwheel.engine.llm_engine import LLMEngine
from spinwheel.engine.sampling_params import SamplingParams
from spinwheel.tinker.losses import LossInputError
from spinwheel.tinker.wire import encode_sample, model_input_tokens

DEFAULT_MAX_TOKENS = 16


@dataclass
class SamplingSession:
    adapter: str | None  # the engine adapter name (its tinker:// path), None: the base model
    model_path: str | None


def sampling_params(raw: dict, num_samples: int, prompt_logprobs: bool) -> SamplingParams:
    """A Tinker ``SamplingParams`` JSON object -> the engine's."""
    stop = raw.get("stop")
    stop_strs: list[str] = []
    stop_ids: list[int] = []
    if isinstance(stop, str):
        stop_strs = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_strs = list(stop)
    elif isinstance(stop, list) and all(isinstance(s, int) for s in stop):
        stop_ids = list(stop)
    elif stop is not None:
        raise LossInputError(f"sampling_params.stop {stop!r}: give a string, a list of strings or of token ids")
    max_tokens = raw.get("max_tokens")
    try:
        return SamplingParams(
            n=num_samples,
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)),
            top_k=max(0, int(raw.get("top_k", -1))),
            seed=raw.get("seed"),
            stop=stop_strs or None,
            stop_token_ids=stop_ids,
            ignore_eos=stop == [],
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens),
            logprobs=0,
            prompt_logprobs=0 if prompt_logprobs else None,
        )
    except ValueError as e:
        raise LossInputError(f"sampling_params: {e}") from None


class Sampler:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.sessions: dict[str, SamplingSession] = {}
        self._counter = 0

    def serve_adapter(self, path: str, local: Path) -> str:
        """Serve the sampler weights saved at ``local`` under their tinker:// ``path`` (once)."""
        if path not in self.engine.loras.slots:
            self.engine.loras.add(path, local)
        return path

    def run(self, requests: list[tuple[str, dict]]) -> list[bytes | Exception]:
        """Sample every (session id, SampleRequest JSON) together in the engine; per request the SampleResponse
        protobuf, or the exception that failed it alone."""
        results: list[bytes | Exception | None] = [None] * len(requests)
        pending: dict[str, int] = {}
        for i, (session_id, req) in enumerate(requests):
            try:
                rid = self._add(session_id, req)
                pending[rid] = i
            except Exception as e:  # this request's own parameters
                results[i] = e
        while pending:
            for out in self.engine.step(stream=False):
                i = pending.pop(out.request_id, None)
                if i is None or not out.finished:
                    continue
                results[i] = self._response(out, requests[i][1])
        return results  # type: ignore[return-value]

    def _add(self, session_id: str, req: dict) -> str:
        session = self.sessions.get(session_id)
        if session is None:
            raise LossInputError(f"no sampling session '{session_id}' in this service: create one first")
        tokens = model_input_tokens(req.get("prompt") or {})
        vocab = self.engine.model.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise LossInputError(f"prompt holds token id {bad[0]}, outside the model's vocabulary [0, {vocab})")
        num = int(req.get("num_samples", 1))
        if num < 1:
            raise LossInputError(f"num_samples {num}: ask for at least 1")
        params = sampling_params(req.get("sampling_params") or {}, num, bool(req.get("prompt_logprobs")))
        params.lora = session.adapter
        rid = f"tinker-sample-{self._counter}"
        self._counter += 1
        self.engine.add_request(rid, tokens, params)
        return rid

    @staticmethod
    def _response(out, req: dict) -> bytes | Exception:
        if out.error is not None:
            return LossInputError(out.error)
        sequences = []
        for c in out.outputs:
            logprobs = [lp.get(t, float("nan")) for t, lp in zip(c.token_ids, c.logprobs or [])]
            reason = "length" if c.finish_reason == "length" else "stop"
            sequences.append((c.token_ids, logprobs if c.logprobs is not None else None, reason))
        prompt = None
        if req.get("prompt_logprobs") and out.prompt_logprobs is not None:
            ids = out.prompt_token_ids
            prompt = [None if d is None else d.get(t) for t, d in zip(ids, out.prompt_logprobs)]
        return encode_sample(sequences, prompt)
