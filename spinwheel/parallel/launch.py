"""Process-group start-up: from ``torchrun``'s environment, or local processes spawned for tests and benchmarks.

``torchrun --nproc-per-node N -m spinwheel ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; :func:`init_distributed` reads them and starts gloo on CPU or NCCL on CUDA with a timeout, so a
dead rank fails the job instead of hanging it. Without those variables it does nothing and the run is one process
(``world_size == 1``), which every wrapper handles on the same code path. Multi-node runs use torchrun's
rendezvous (``--nnodes``, ``--rdzv-backend c10d --rdzv-endpoint host:port``); nothing here changes.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 600.0


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Initialise ``torch.distributed`` from the torchrun environment; returns (rank, world_size).

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise. Returns (0, 1) and initialises nothing
    when the environment names no world (a plain ``python`` run).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return 0, 1
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size


def launched_world_size() -> int:
    """The number of processes of this job: the initialised world's, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args: tuple, queue, timeout_s: float, threads: int,
            backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        init_distributed(backend, timeout_s=timeout_s)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            destroy_distributed()
        except Exception:
            pass


def spawn(fn, world_size: int, args: tuple = (), timeout_s: float = 240.0, threads: int = 1,
          backend: str = "gloo") -> list[object]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes (gloo, or ``backend="nccl"`` with rank
    r on GPU r); returns the results by rank.

    ``fn`` must be importable (module level). A rank that raises makes this raise with its traceback; a run longer
    than ``timeout_s`` is killed and raises :class:`TimeoutError` — nothing hangs.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout_s, threads, backend),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    ok = False
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) + len(errors) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"spawned ranks did not finish within {timeout_s}s "
                                   f"({len(results)} of {world_size} done)\n" + "\n".join(errors))
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not errors:
                    raise RuntimeError(f"rank process exited with code {dead[0].exitcode} without a report")
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break  # one failure is enough; peers may be blocked on it
        if errors:
            raise RuntimeError("spawned rank failed\n" + "\n".join(errors))
        ok = True
    finally:
        for p in procs:
            p.join(timeout=10 if ok else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]
