"""The pipeline bubble (K − 1)/(M + K − 1) (Huang et al., 2019, "GPipe", §2.2; Narayanan et al., 2021, §2.2 for
1F1B) for K = 2, 3, 4 stages and M = 1, 2, 3, 4, 8 micro-batches, counted in slots of the real schedule — not timed.

The ranks run :class:`~spinwheel.parallel.pipeline.PipelineSchedule` itself (its orders, its blocking receives and
non-blocking sends, over gloo), on stages whose compute is a *logical clock*: a forward costs F slots, a backward B,
and each starts at the later of the stage's own clock and the slot its input was produced at — carried inside the
activation (channel 0) and its gradient, so a stage learns when its input was ready from the data it receives. That
is the slot schedule of a pipeline with equal stage costs, as the schedule's real communication orders it. Over the
step's makespan S, stage s is busy M(F + B) slots; its idle share 1 − M(F + B)/S is the bubble, and with
S = (M + K − 1)(F + B) it is (K − 1)/(M + K − 1) on every stage, exactly, for GPipe and 1F1B alike. F = 1, B = 2
(a backward costs about two forwards).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spinwheel.parallel import spawn
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.pipeline import PipelineSchedule, bubble_fraction

WORLD, HIDDEN, F, B = 4, 4, 1, 2
STAGES, MICROBATCHES = (2, 3, 4), (1, 2, 3, 4, 8)


class Ledger:
    """A stage's logical clock: ``now`` (the slot its last op ended at) and the slots it computed in."""

    def __init__(self) -> None:
        self.now, self.busy, self.ops = 0, 0, []

    def run(self, op: str, ready: float, cost: int) -> int:
        start = max(self.now, int(ready))
        self.now, self.busy = start + cost, self.busy + cost
        self.ops.append((op, start, self.now))
        return self.now


class _Clocked(torch.autograd.Function):
    """Identity-like compute of fixed slot cost; channel 0 of the output (and of the input's gradient) carries the
    slot its computation ended at."""

    @staticmethod
    def forward(ctx, x, weight, ledger):
        ctx.ledger = ledger
        out = x * weight  # (b, T, C)
        out[..., 0] = ledger.run("F", x[0, 0, 0].item(), F)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad.clone()
        grad_x[..., 0] = ctx.ledger.run("B", grad[0, 0, 0].item(), B)
        return grad_x, torch.zeros(grad.shape[-1]), None


class ClockStage(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first, self.ledger = first, Ledger()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # token ids (b, T) -> (b, T, C), ready at slot 0
            x = torch.zeros(*x.shape, HIDDEN)
        return _Clocked.apply(x, self.weight, self.ledger)


def _loss(out: torch.Tensor, i: int) -> torch.Tensor:
    return out[..., 1:].pow(2).mean()  # no gradient into the clock channel: the last stage's backward is local


def worker(rank: int, world_size: int) -> dict:
    groups = {k: dist.new_group(list(range(k))) for k in STAGES}  # every rank creates every group
    out = {}
    for k, group in groups.items():
        if rank >= k:
            continue
        axis = Axis(f"pp{k}", tuple(range(k)), rank, group)
        for schedule in ("gpipe", "1f1b"):
            for m in MICROBATCHES:
                stage = ClockStage(rank == 0)
                sched = PipelineSchedule(stage, axis, Comm(timeout_s=60), schedule, HIDDEN, torch.float32)
                sched.step([torch.zeros(1, 2, dtype=torch.long) for _ in range(m)], _loss)
                out[k, schedule, m] = (stage.ledger.busy, stage.ledger.now, stage.ledger.ops)
    return out


@pytest.fixture(scope="module")
def slots() -> list[dict]:
    return spawn(worker, WORLD, timeout_s=120)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", STAGES)
def test_counted_bubble_is_the_formula(slots, schedule, k):
    for m in MICROBATCHES:
        stages = [slots[s][k, schedule, m] for s in range(k)]
        makespan = max(now for _, now, _ in stages)
        assert makespan == (m + k - 1) * (F + B), (k, schedule, m, makespan)
        for s, (busy, _, ops) in enumerate(stages):
            assert busy == m * (F + B) and len(ops) == 2 * m
            bubble = Fraction(makespan - busy, makespan)
            assert bubble == Fraction(k - 1, m + k - 1), (k, schedule, m, s, bubble)
            assert float(bubble) == pytest.approx(bubble_fraction(k, m))


@pytest.mark.slow
@pytest.mark.distributed
def test_1f1b_runs_its_backwards_before_gpipe_does(slots):
    # Same bubble, different order: on stage 0 of 4 with M = 8, 1F1B's first backward comes after K − 1 warm-up
    # forwards and one more, GPipe's only after all M forwards.
    first_backward = {
        s: next(i for i, (op, _, _) in enumerate(slots[0][4, s, 8][2]) if op == "B") for s in ("gpipe", "1f1b")
    }
    assert first_backward == {"gpipe": 8, "1f1b": 4}
