"""What crosses between rollout ranks and trainer ranks (:mod:`~spinwheel.rl.llm.rollouts.rollout_ranks`), as tensors
over
``torch.distributed`` (gloo on CPU, NCCL on GPU), every wait bounded by a timeout.

* **Episodes** (rollout rank → trainer rank 0, point to point): a step's episodes packed into four tensors — a
  header (int64: kind, step, sizes), the integers (int64: per-episode counts and flags, then token ids, masks, turn
  ends and the version of every sampled token), the floats (float64: the step's times, then rewards, behaviour
  log-probs and turn rewards — float64 holds the engine's values exactly) and the text (uint8: per-episode JSON of
  turn texts, end reason, error and info figures). :func:`unpack_episodes` rebuilds equal :class:`Episode` records.
* **Weights** (trainer rank 0 → every rollout rank, a broadcast): the state's tensors in a fixed order, one stream per
  dtype, cut into flat buffers of a fixed byte size (:data:`BUCKET_MB`); a tensor may span two buckets. Memory in
  flight is one bucket, whatever the model's size.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from spinwheel.rl.llm.episode_tokens import Episode

BUCKET_MB = 16.0  # bytes of one broadcast buffer of weights, in MiB
EPISODES, FAILED = 1, 2  # kinds of an episodes message: a step's batch, or the error that failed the step
_COUNTS = 12  # integers per episode before the token lists
# The floats a batch message starts with: the step's times, then the engine's counts so far.
_TIMES = ("generate", "score", "wait_weights", "weight_swaps", "kv_recomputed")


class LinkError(TimeoutError):
    """A peer rank that did not answer within the timeout, or is gone (a one-line message naming it)."""


def wait(work, timeout_s: float, what: str, times: int = 1) -> None:
    """Wait for ``work`` at most ``times`` × ``timeout_s`` (``--timeout-s``); a timeout or a broken connection raises
    :class:`LinkError`."""
    limit = f"--timeout-s {timeout_s:g} s" if times == 1 else f"{times} × --timeout-s {timeout_s:g} s"
    try:
        ok = work.wait(datetime.timedelta(seconds=times * timeout_s))
    except RuntimeError as e:  # gloo: "Timed out waiting ...", or the peer closed its connection
        late = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        why = f"nothing within {limit} (hung or too slow)" if late else "its connection broke"
        raise LinkError(f"{what}: {why} ({str(e).splitlines()[0][:160]})") from None
    if ok is False:
        raise LinkError(f"{what}: nothing within {limit} (hung or too slow)")


# ---- episodes ----------------------------------------------------------------------------------------------------


def pack_episodes(episodes: Sequence[Episode], times: dict[str, float]) -> list[torch.Tensor]:
    """The step's ``episodes`` and the rollout rank's ``times`` as (ints, floats, text) tensors (module docstring)."""
    ints: list[int] = []
    floats: list[float] = [float(times.get(k, 0.0)) for k in _TIMES]
    texts = []
    for e in episodes:
        flags = [e.done, e.truncated, e.failed, e.drift]
        lists = [e.token_ids, e.turn_ends, e.versions]
        ints += [e.env_index, e.sample_index, e.env_seed, e.prompt_len, e.num_turns, *map(int, flags)]
        ints += [len(x) for x in lists]
        ints += [*e.token_ids, *e.mask, *e.turn_ends, *e.versions]
        floats += [e.reward, *e.engine_logprobs, *e.turn_rewards]
        texts.append([e.turn_texts, e.end_reason, e.error, e.info])
    blob = json.dumps(texts).encode()
    return [
        torch.tensor(ints, dtype=torch.long),
        torch.tensor(floats, dtype=torch.float64),
        torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8),
    ]


def unpack_episodes(ints: torch.Tensor, floats: torch.Tensor, blob: torch.Tensor) -> tuple[list[Episode], dict]:
    """The inverse of :func:`pack_episodes`: (episodes, times)."""
    i, f = _Cursor(ints.tolist()), _Cursor(floats.tolist())
    times = dict(zip(_TIMES, f.take(len(_TIMES))))
    out = []
    for turn_texts, end_reason, error, info in json.loads(bytes(blob.tolist()).decode() or "[]"):
        head = i.take(_COUNTS)
        n, turns, versions = head[9:12]
        tokens, mask, ends, vers = i.take(n), i.take(n), i.take(turns), i.take(versions)
        reward, logps, rewards = f.take(1)[0], f.take(n), f.take(turns)
        done, truncated, failed, drift = (bool(x) for x in head[5:9])
        out.append(
            Episode(
                *head[:3],
                token_ids=tokens,
                mask=mask,
                engine_logprobs=logps,
                prompt_len=head[3],
                turn_ends=ends,
                turn_rewards=rewards,
                turn_texts=turn_texts,
                reward=reward,
                num_turns=head[4],
                done=done,
                truncated=truncated,
                end_reason=end_reason,
                failed=failed,
                error=error,
                info=info,
                drift=drift,
                versions=vers,
            )  # fmt: skip
        )
    return out, times


class _Cursor:
    def __init__(self, values: list) -> None:
        self.values, self.at = values, 0

    def take(self, n: int) -> list:
        self.at += n
        return self.values[self.at - n : self.at]


def send_message(kind: int, step: int, parts: list[torch.Tensor], dst: int, group, device) -> list:
    """Start sending a message (header, then ``parts``) to global rank ``dst``; returns the works to wait for (the
    tensors stay referenced by the caller until then)."""
    parts = [p.to(device) for p in parts]
    header = torch.tensor([kind, step, *(p.numel() for p in parts)], dtype=torch.long, device=device)
    try:
        works = [dist.isend(header, dst=dst, group=group)]
        works += [dist.isend(p, dst=dst, group=group) for p in parts if p.numel()]
    except RuntimeError as e:  # gloo: the peer closed its connection
        raise LinkError(f"rank {dst} is gone ({str(e).splitlines()[0][:160]})") from None
    return [works, header, parts]


def recv_message(src: int, group, device, timeout_s: float, what: str) -> tuple[int, int, list[torch.Tensor]]:
    """Receive one message from global rank ``src``: (kind, step, [ints, floats, text])."""
    header = torch.zeros(5, dtype=torch.long, device=device)
    wait(dist.irecv(header, src=src, group=group), timeout_s, what)
    kind, step, *sizes = header.tolist()
    parts = [torch.zeros(n, dtype=d, device=device) for n, d in zip(sizes, (torch.long, torch.float64, torch.uint8))]
    for p in parts:
        if p.numel():
            wait(dist.irecv(p, src=src, group=group), timeout_s, what)
    return kind, step, [p.cpu() for p in parts]


def error_message(text: str) -> list[torch.Tensor]:
    blob = text.encode()
    return [
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.float64),
        torch.tensor(list(blob), dtype=torch.uint8),
    ]


def error_text(parts: list[torch.Tensor]) -> str:
    return bytes(parts[2].tolist()).decode()


# ---- weights -----------------------------------------------------------------------------------------------------


def weight_tensors(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a weight broadcast carries, in its fixed order (by name; rotary tables are not weights)."""
    return [state[k] for k in sorted(state) if not k.startswith("rotary.")]


def buckets(sizes: Sequence[int], capacity: int) -> Iterator[list[tuple[int, int, int]]]:
    """Cut a stream of tensors of ``sizes`` elements into buckets of at most ``capacity`` elements: each bucket a
    list of (tensor index, offset in it, count), in stream order."""
    bucket, used = [], 0
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            n = min(size - offset, capacity - used)
            bucket.append((index, offset, n))
            used, offset = used + n, offset + n
            if used == capacity:
                yield bucket
                bucket, used = [], 0
    if bucket:
        yield bucket


def broadcast_weights(
    tensors: list[torch.Tensor],
    is_source: bool,
    send: Callable[[torch.Tensor], None],
    bucket_mb: float = BUCKET_MB,
    device: torch.device | str = "cpu",
) -> int:
    """Broadcast ``tensors`` (the source's values into every other rank's) through flat buffers of ``bucket_mb``
    MiB, one dtype stream at a time; ``send(buffer)`` is the broadcast of one filled buffer. Returns the bytes
    carried."""
    total = 0
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        flats = [t.detach().reshape(-1) if is_source else t.view(-1) for t in tensors if t.dtype == dtype]
        capacity = max(1, int(bucket_mb * 2**20) // torch.empty(0, dtype=dtype).element_size())
        buffer = torch.empty(min(capacity, sum(f.numel() for f in flats)), dtype=dtype, device=device)
        for bucket in buckets([f.numel() for f in flats], capacity):
            pos = 0
            for index, offset, n in bucket:
                if is_source:
                    buffer[pos : pos + n].copy_(flats[index][offset : offset + n])
                pos += n
            send(buffer[:pos])
            if not is_source:
                pos = 0
                for index, offset, n in bucket:
                    flats[index][offset : offset + n].copy_(buffer[pos : pos + n])
                    pos += n
            total += pos * buffer.element_size()
    return total
