"""What a black-box agent's model calls were, token for token, and the :class:`Episode` they make
(:mod:`~spinwheel.rl.llm.agents.agent_proxy` runs the agents).

The agent talks to spinwheel's OpenAI-compatible server through an ``openai`` client whose HTTP transport is a
:class:`RecordingTransport`. On every ``/v1/completions`` and ``/v1/chat/completions`` call it asks the server for
what a trainer needs, and keeps it: vLLM's ``return_token_ids`` (the prompt's token ids as the engine was fed them
and the ids it sampled), the sampled tokens' log-probs of the distribution they were drawn from (``logprobs`` with
``logprobs_mode="processed"``), and a seed per call when the agent gave none (the run's episodes are then a function
of the run's seed and the weights, as :func:`~spinwheel.rl.llm.episodes.turn_seed` makes environment episodes).
Fields the agent did not ask for are taken out of the response again, so the agent sees the API it was written
against. Nothing is re-tokenised: the ids are the engine's.

Calls chain (:func:`chain_calls`): call ``k`` continues the episode when its prompt starts with everything so far
(the previous call's prompt and completion) — an agent that appends the model's text and the tool's answer to its
prompt, or a chat whose template re-renders the history to the same tokens. The new prompt tokens are not trained on
(mask 0), the sampled ones are (mask 1, with their log-probs). A prompt that does not extend the history (the agent
edited or dropped it, or the chat template re-tokenised the model's text otherwise) starts a new **segment**; the
episode trains on the last segment (where the final answer was given), and counts the breaks in
``info["agent_segments"]``. All segments stay on :attr:`AgentEpisode.segments`.

A call the recorder cannot attribute to one sampled sequence fails the episode (it is counted, never trained on):
``stream=True`` (not recorded), ``n`` / ``best_of`` > 1 or a batch of prompts (which choice the agent used is
unknown).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from spinwheel.models.tokenizer import Tokenizer
from spinwheel.rl.llm.episode_tokens import Episode, has_drift
from spinwheel.rl.llm.rewards import finite_float32

GENERATION_PATHS = ("/completions", "/chat/completions")


@dataclass
class ModelCall:
    """One recorded call: the prompt the engine was fed, the tokens it sampled and their log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str


@dataclass
class CallChain:
    """Calls whose prompts extend one another, as one token sequence (mask 1 on sampled tokens)."""

    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turn_ends: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def extends(self, call: ModelCall) -> bool:
        n = len(self.token_ids)
        return n > 0 and len(call.prompt_ids) >= n and call.prompt_ids[:n] == self.token_ids

    def add(self, call: ModelCall) -> None:
        """Append ``call``: the prompt's new tokens (mask 0), then the sampled ones (mask 1)."""
        if not self.token_ids:
            self.prompt_len = len(call.prompt_ids)
        new = call.prompt_ids[len(self.token_ids) :]
        self.token_ids += new + call.completion_ids
        self.mask += [0] * len(new) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(new) + list(call.logprobs)
        self.turn_ends.append(len(self.token_ids) - 1)
        self.texts.append(call.text)


@dataclass
class AgentEpisode(Episode):
    """An :class:`Episode` of a black-box agent: the last segment's tokens, and every segment."""

    segments: list[CallChain] = field(default_factory=list)


def chain_calls(calls: list[ModelCall]) -> list[CallChain]:
    """The calls as segments: a call whose prompt extends the current segment's tokens continues it, any other starts
    a new one."""
    chains: list[CallChain] = []
    for call in calls:
        if not chains or not chains[-1].extends(call):
            chains.append(CallChain())
        chains[-1].add(call)
    return chains


def agent_episode(
    calls: list[ModelCall],
    reward: object,
    error: str | None,
    tokenizer: Tokenizer,
    env_index: int,
    sample_index: int,
    env_seed: int,
) -> AgentEpisode:
    """The episode of one agent run: its calls chained (module docstring), the reward on its last call. ``error``
    (the agent raised, timed out, or made a call that cannot be recorded), a reward that is not a finite number,
    or no recorded call fail it."""
    chains = chain_calls(calls)
    e = AgentEpisode(env_index, sample_index, env_seed, segments=chains)
    if error is None and not calls:
        error = "the agent made no model call"
    if error is None and (
        isinstance(reward, bool) or not isinstance(reward, (int, float)) or not finite_float32(reward)
    ):
        error = f"the agent returned {reward!r:.40}, not a finite number within float32's range (±3.4e38)"
    if chains:
        last = chains[-1]
        e.token_ids, e.mask, e.engine_logprobs = list(last.token_ids), list(last.mask), list(last.logprobs)
        e.prompt_len, e.turn_ends, e.turn_texts = last.prompt_len, list(last.turn_ends), list(last.texts)
        e.drift = has_drift(tokenizer, e.token_ids)
    e.num_turns = len(calls)
    e.info = {"agent_calls": float(len(calls)), "agent_segments": float(len(chains))}
    if error is not None:
        e.failed, e.error, e.end_reason = True, error, "failed"
        return e
    e.reward = float(reward)  # type: ignore[arg-type]
    e.turn_rewards = [0.0] * (len(e.turn_ends) - 1) + [e.reward]
    e.done, e.end_reason = True, "done"
    return e


class RecordingTransport(httpx.BaseTransport):
    """An httpx transport that records the model calls passing through it (module docstring). ``seed_of(k)`` is
    the seed of the run's ``k``-th call when the agent gives none; ``model`` replaces the request's model name (every
    call is served by the current policy). After :meth:`close_run` every request fails: a timed-out agent that goes
    on calling is refused."""

    def __init__(self, inner: httpx.BaseTransport, model: str, seed_of: Callable[[int], int]) -> None:
        self.inner, self.model, self.seed_of = inner, model, seed_of
        self.calls: list[ModelCall] = []
        self.error: str | None = None  # the first call that could not be recorded
        self._closed = threading.Event()
        self._num_requests = 0
        self._lock = threading.Lock()  # an agent may call from several threads

    def close_run(self) -> None:
        self._closed.set()

    def close(self) -> None:
        pass  # the inner transport is shared by the runs: its owner closes it

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed.is_set():
            raise httpx.ConnectError("the agent run is over (it timed out): no more model calls", request=request)
        path = request.url.path
        if request.method != "POST" or not path.endswith(GENERATION_PATHS):
            return self.inner.handle_request(request)
        chat = path.endswith("/chat/completions")
        body = json.loads(request.content or b"{}")
        problem = _unrecordable(body, chat)
        if problem is not None:
            self.error = self.error or problem
            raise httpx.ConnectError(f"spinwheel's agent proxy cannot record this call: {problem}", request=request)
        strip = self._ask_for_tokens(body, chat)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
        sent = httpx.Request("POST", request.url, headers=headers, content=json.dumps(body).encode())
        response = self.inner.handle_request(sent)
        if response.status_code != 200:
            return response
        response.read()
        data = json.loads(response.content)
        call = _recorded_call(data, chat)
        if call.completion_ids:  # not a prompt scored with echo and max_tokens=0
            with self._lock:
                self.calls.append(call)
        choice = data["choices"][0]
        for key in strip:
            if key == "logprobs":
                choice["logprobs"] = None
            else:
                (data if key == "prompt_token_ids" and chat else choice).pop(key, None)
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-encoding")}
        return httpx.Response(200, headers=headers, content=json.dumps(data).encode(), request=request)

    def _ask_for_tokens(self, body: dict, chat: bool) -> list[str]:
        """Add to ``body`` what recording needs; the response fields to take out again."""
        strip = [] if body.get("return_token_ids") else ["prompt_token_ids", "token_ids"]
        body["return_token_ids"] = True
        if chat and not body.get("logprobs"):
            body["logprobs"] = True
            strip.append("logprobs")
        if not chat and body.get("logprobs") is None:
            body["logprobs"] = 0
            strip.append("logprobs")
        body["logprobs_mode"] = "processed"  # of the distribution the tokens were drawn from
        body["model"] = self.model
        with self._lock:
            k, self._num_requests = self._num_requests, self._num_requests + 1
        if body.get("seed") is None:
            body["seed"] = self.seed_of(k)
        return strip


def _unrecordable(body: dict, chat: bool) -> str | None:
    """Why a call cannot be attributed to one sampled sequence (None when it can)."""
    if body.get("stream"):
        return "stream=True is not recorded (call without streaming)"
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return "n or best_of > 1 (which choice the agent kept is unknown)"
    if body.get("use_beam_search"):
        return "beam search"
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return "a batch of prompts (send one prompt per call)"
    return None


def _recorded_call(data: dict, chat: bool) -> ModelCall:
    """The call in a response that carries token ids and log-probs (as :class:`RecordingTransport` asks)."""
    choice = data["choices"][0]
    ids = list(choice["token_ids"])
    if chat:
        prompt = data["prompt_token_ids"]
        lps = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        text = choice["message"]["content"] or ""
    else:
        prompt = choice["prompt_token_ids"]
        lps = choice["logprobs"]["token_logprobs"][len(choice["logprobs"]["token_logprobs"]) - len(ids) :]
        text = choice["text"]
    return ModelCall(list(prompt), ids, [float(v) for v in lps], text)
