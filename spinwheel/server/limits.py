"""What one client may hold or ask for. Every field is a ``spinwheel serve`` option (through :class:`ServeConfig`,
which extends this class); the defaults are safe against slow and greedy clients: a few hundred thousand
half-open connections, unread streams or giant batch bodies leave the server answering others."""

from __future__ import annotations

import resource
from dataclasses import dataclass

from spinwheel.config import check_ranges, option

FD_RESERVE = 128  # descriptors kept for the model files, the listening socket, logs and the runtime


@dataclass
class ServerLimits:
    """Connection and request limits."""

    max_connections: int = option(
        1024,
        help="open HTTP connections at most; at the cap a new connection replaces the one that has waited "
        "longest for its request headers, or is refused with 503 (kept below `ulimit -n`)",
    )
    header_timeout_s: float = option(
        10.0,
        help="seconds a connection may take to send a request's headers, from connecting or from the "
        "previous response (slower connections are closed: slowloris)",
    )
    max_header_kb: int = option(
        64,
        help="a request head (request line and headers) still incomplete after this many KiB is answered 431 and "
        "its connection closed",
    )
    body_timeout_s: float = option(30.0, help="seconds a client may take to send a request body (slower: 408)")
    stall_timeout_s: float = option(
        30.0,
        help="seconds a client may leave its response unread before it is disconnected and its request "
        "aborted (its KV blocks freed)",
    )
    send_buffer_kb: int = option(
        256,
        help="kernel send buffer per connection, KiB: bounds what a client that stops reading pins in the "
        "kernel before the stall timeout starts (0: the OS's autotuning, up to MBs per connection)",
    )
    max_sequences_per_request: int = option(1024, help="prompts x n in one request at most (more: HTTP 400)")
    max_logprobs_per_request: int = option(
        1_000_000,
        help="log-prob entries one request may ask for at most: scored tokens (prompt and output, every choice) x "
        "(top-k + 1); about 25 bytes of response each (more: HTTP 400)",
    )
    log_repeat_interval_s: float = option(
        10.0, help="a repeated warning or error is logged once per interval, with the number suppressed"
    )
    health_stall_s: float = option(
        60.0,
        help="/health answers 503 when the engine has had unfinished requests for this many seconds without "
        "producing a token or finishing a request",
    )

    def __post_init__(self) -> None:
        check_ranges(
            self,
            at_least_1=("max_connections", "max_header_kb", "max_sequences_per_request", "max_logprobs_per_request"),
            non_negative=("send_buffer_kb",),
            positive=(
                "header_timeout_s",
                "body_timeout_s",
                "stall_timeout_s",
                "log_repeat_interval_s",
                "health_stall_s",
            ),
        )


def fit_connections_to_fd_limit(max_connections: int) -> tuple[int, str | None]:
    """``max_connections`` that this process can hold open: the soft ``RLIMIT_NOFILE`` is raised toward the hard
    limit when needed, and the cap lowered (with a note saying so) when even that is too small."""
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections, None
    fitted = max(1, soft - FD_RESERVE)
    return fitted, (
        f"--max-connections lowered from {max_connections} to {fitted}: this process may open "
        f"{soft} file descriptors (ulimit -n)"
    )
