"""Process-group start-up: from ``torchrun``'s environment, or local processes spawned for tests and benchmarks.

``torchrun --nproc-per-node N -m spinwheel ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; :func:`init_distributed` reads them and starts gloo on CPU or NCCL on CUDA with a timeout, so a
dead rank fails the job instead of hanging it. Without those variables it does nothing and the run is one process
(``world_size == 1``), which every wrapper handles on the same code path. Multi-node runs use torchrun's
rendezvous (``--nnodes``, ``--rdzv-backend c10d --rdzv-endpoint host:port``); nothing here changes.

:func:`launch` (``spinwheel launch [torchrun options] COMMAND [options]``) is torchrun itself — the same elastic
agent and options — running ``python -m spinwheel COMMAND`` on every process, except that it passes the workers'
exit status through: torchrun's ``main`` re-raises any worker's non-zero exit as a ``ChildFailedError`` traceback
and a Ctrl-C as a ``SignalException`` traceback, both with status 1, even when the workers said all there was to
say in one line (a bad layout: status 2; an interrupted run that saved its checkpoint: 130).
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import sys
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
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size


def launched_world_size() -> int:
    """The number of processes of this job: the initialised world's, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def lost_peer(exc: BaseException) -> str | None:
    """Under torchrun, when ``exc`` (or an exception it was raised from or during) is a collective that failed
    because another rank died or dropped its connection: that collective's first line; else None."""
    if launched_world_size() <= 1:
        return None
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen).strip().splitlines()[0] if str(seen).strip() else ""
        if isinstance(seen, RuntimeError) and any(s in text for s in PEER_LOST):
            return text.split("] ", 1)[-1].split(". ")[0][:160]  # gloo prefixes its source location
        seen = seen.__cause__ or seen.__context__
    return None


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


QUIET_EXIT_CODES = (2, 130, 143)  # spinwheel's own: a one-line error, an interrupted run with its checkpoint


def launch(argv: list[str]) -> int:
    """Run ``torchrun [options] -m spinwheel COMMAND ...`` in this process; returns the exit status: 0, the first
    failed worker's (its own one-line message already on the console; others get one line naming the rank), or
    128 + N when this launcher got signal N (torchrun forwarded it and waited for the workers to save and exit)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog, parser.usage = "spinwheel launch", "spinwheel launch [torchrun options] COMMAND [options]"
    parser.description = (
        "torchrun for spinwheel: starts 'python -m spinwheel COMMAND [options]' on every process "
        "(torchrun's options, below) and exits with the workers' status, without torchrun's "
        "tracebacks."
    )
    for action in parser._actions:  # torchrun's positionals are the script and its arguments: here, a command
        if action.dest in ("training_script", "training_script_args"):
            action.metavar = "COMMAND" if action.dest == "training_script" else "OPTIONS"
            action.help = (  # torchrun's: "Full path to the (single GPU) training program/script ..."
                "the spinwheel command each process runs (sft, grpo, dpo, classic, ...)"
                if action.dest == "training_script"
                else "its options, as 'spinwheel COMMAND --help' lists them"
            )
    args = parser.parse_args(argv)
    if (why := _bad_launch(args)) is not None:
        print(f"spinwheel launch: error: {why} ('spinwheel launch --help' lists the options)", file=sys.stderr)
        return 2
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.module = "spinwheel", True
    for name in list(logging.root.manager.loggerDict):  # the agent's failure and shutdown logs: said below
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except (ValueError, AssertionError) as e:  # torchrun's checks of its own options, before any worker starts
        why = f"torchrun's options: {e or type(e).__name__}"
        print(f"spinwheel launch: error: {why} ('spinwheel launch --help' lists them)", file=sys.stderr)
        return 2
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode  # killed by signal N: 128 + N
        if code not in QUIET_EXIT_CODES:
            print(f"spinwheel launch: rank {rank} exited with status {code}", file=sys.stderr)
        return code
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def _bad_launch(args) -> str | None:
    """What torchrun would answer with a traceback (or start a launcher in every worker for): one line, else None."""
    n = str(args.nproc_per_node)
    if not (n in ("auto", "cpu", "gpu", "xpu") or (n.isdigit() and int(n) >= 1)):
        return f"--nproc-per-node {n}: expected a number >= 1, or auto, cpu, gpu, xpu"
    if args.training_script == "launch":
        return "launch inside launch: give the command itself (spinwheel launch --nproc-per-node 2 sft ...)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every spawned rank imports anyway (torch._dynamo: the first optimizer's ``add_param_group`` does), loaded once
# in the fork server rather than in each rank.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "spinwheel", "spinwheel.parallel"]


def rank_context():
    """The multiprocessing context that starts local ranks: the fork server, with :data:`FORKSERVER_PRELOAD` (which
    must be set before the server's first start, hence one place that hands the context out)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn,
    args: tuple,
    queue,
    timeout_s: float,
    threads: int,
    backend: str,
    environ: dict[str, str],
) -> None:
    # A fresh process, as under "spawn": the caller's environment of now (the fork server's is from its start) and
    # random streams of its own (the fork server seeded Python's once for every rank).
    os.environ.clear()
    os.environ.update(environ)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
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


def spawn(
    fn, world_size: int, args: tuple = (), timeout_s: float = 240.0, threads: int = 1, backend: str = "gloo"
) -> list[object]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes (gloo, or ``backend="nccl"`` with rank
    r on GPU r); returns the results by rank.

    ``fn`` must be importable (module level). A rank that raises makes this raise with its traceback; a run longer
    than ``timeout_s`` is killed and raises :class:`TimeoutError` — nothing hangs.

    Gloo ranks are fresh processes forked from multiprocessing's fork server, which imports torch and spinwheel once
    (:data:`FORKSERVER_PRELOAD`) and never runs a rank itself: a rank starts in milliseconds instead of seconds, and
    exits without tearing its interpreter down. Each gets this process's environment and ``sys.path`` as of the call.
    NCCL ranks are spawned (a fresh interpreter each): nothing that may have touched the CUDA driver is forked.
    """
    ctx = rank_context() if backend == "gloo" else mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, queue, timeout_s, threads, backend, environ),
            daemon=True,
        )
        for r in range(world_size)
    ]
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
                raise TimeoutError(
                    f"spawned ranks did not finish within {timeout_s}s "
                    f"({len(results)} of {world_size} done)\n" + "\n".join(errors)
                )
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not errors:
                    raise RuntimeError(f"rank process exited with code {dead[0].exitcode} without a report") from None
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
