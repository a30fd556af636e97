"""Disaggregated placement (``--rollout-ranks R``): a rollout rank plays the episodes, the trainer rank trains; with
K = 0 two processes equal one process's run bit for bit (rollouts, rewards, losses, weights); a rollout rank that
hangs stops the trainer within ``--timeout-s``; the episodes and the bucketed weights cross ranks unchanged."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import small_config

from spinwheel.models.hf import load_model
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.episode_tokens import Episode
from spinwheel.rl.llm.rollouts.rollout_wire import BUCKET_MB, broadcast_weights, buckets, pack_episodes, unpack_episodes
from spinwheel.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("digit_reward")  # the reward module `rl_test_reward:digits` (helpers.py)


def _steps(path) -> list[dict]:
    return [r for r in read_metrics(path / "metrics.jsonl") if "reward_mean" in r]


def _hang(*args, **kwargs) -> list:
    should_stop, deadline = args[6], time.monotonic() + 60
    while not should_stop() and time.monotonic() < deadline:
        time.sleep(0.05)
    return []


def _placement_worker(rank: int, world: int, root: str) -> dict:
    import spinwheel.rl.llm.rollouts.rollout_play as rollout_play

    out: dict = {}
    try:
        train_rl(small_config(f"{root}/bad", steps=1, rollout_ranks=2))
    except ValueError as e:
        out["too_many"] = str(e)
    out["first"] = train_rl(small_config(f"{root}/r1", steps=3, rollout_ranks=1, stop_after=2))
    out["run"] = train_rl(small_config(f"{root}/r1", steps=3, rollout_ranks=1))  # resumes at step 2
    if rank == 1:  # then the rollout rank hangs in its first step, until the trainer gives up
        rollout_play.play_share = _hang
    start = time.perf_counter()
    try:
        train_rl(small_config(f"{root}/hang", steps=2, rollout_ranks=1, parallel=ParallelConfig(timeout_s=2)))
    except Exception as e:  # noqa: BLE001 - what each rank ended with
        out["hang"] = f"{type(e).__name__}: {e}", time.perf_counter() - start
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_rollout_rank_run_equals_one_process(tmp_path):
    """`--rollout-ranks 1` in 2 processes, stopped after 2 steps and rerun: the same episodes, rewards, losses and
    final weights as one process (fp32, bit for bit), the weights broadcast after each update and logged; R >= N is
    refused on every rank; a rollout rank that then hangs stops the trainer with one line within --timeout-s."""
    train_rl(small_config(tmp_path / "one", steps=3))
    results = spawn(_placement_worker, 2, args=(str(tmp_path),), timeout_s=300)
    for r in results:
        assert "leaves no trainer rank in a world of 2 processes" in r["too_many"]
    assert [r["first"]["steps"] for r in results[1:]] == [2] and results[1]["run"]["steps"] == 1
    assert results[0]["run"]["start_step"] == 2  # the rerun resumed; its last step equals the one-process run's
    one, two = _steps(tmp_path / "one"), _steps(tmp_path / "r1")
    assert len(one) == 3 and len(set(r["reward_mean"] for r in one)) > 1
    for key in ("reward_mean", "response_len", "loss", "kl_ref", "grad_norm", "mismatch_max"):
        assert [r[key] for r in two] == [r[key] for r in one], key
    n_bytes = sum(p.numel() * 4 for p in load_model(tmp_path / "one" / "checkpoint").parameters())
    for r in two:
        assert r["broadcast_s"] > 0 and r["broadcast_mb"] == pytest.approx(n_bytes / 2**20, rel=0.05)
        assert r["time/wait_rollout"] >= 0 and "time/generate" in r
    want = load_model(tmp_path / "one" / "checkpoint").state_dict()
    for name, w in load_model(tmp_path / "r1" / "checkpoint").state_dict().items():
        assert torch.equal(w, want[name]), name
    message, seconds = results[0]["hang"]
    assert message.startswith("LinkError: rollout rank 1 sent no episodes for step 0: nothing within --timeout-s 2 s")
    assert "\n" not in message and seconds < 15
    ended = results[1]["hang"][0]  # the rollout rank ends too, in one line (the trainer's word or a lost link)
    assert ended.split(":")[0] in ("ValueError", "LinkError") and "\n" not in ended


def _three_ranks_worker(rank: int, world: int, root: str) -> None:
    train_rl(small_config(f"{root}/dp2", steps=3, rollout_ranks=1))  # 2 data-parallel trainer ranks
    train_rl(small_config(f"{root}/r2", steps=3, rollout_ranks=2))  # 2 rollout ranks, a share of the groups each
    train_rl(small_config(f"{root}/k1", steps=3, rollout_ranks=2, max_staleness=1))  # they run one update ahead


def _sync_dp2_worker(rank: int, world: int, root: str) -> None:
    train_rl(small_config(f"{root}/sync_dp2", steps=3))  # today's synchronous loop under --dp 2


@pytest.mark.slow
@pytest.mark.distributed
def test_three_ranks_two_trainers_or_two_rollout_ranks(tmp_path):
    """In 3 processes: 2 data-parallel trainer ranks (their own group) at --max-staleness 0 take the same steps as
    the synchronous loop under --dp 2, bit for bit, and as one process to rounding; 2 rollout ranks with one
    trainer equal one process bit for bit; with --max-staleness 1 they sample ahead on weights at most one update
    old, swapped in between engine steps."""
    train_rl(small_config(tmp_path / "one", steps=3))
    spawn(_three_ranks_worker, 3, args=(str(tmp_path),), timeout_s=300)
    one, dp2, r2 = (_steps(tmp_path / name) for name in ("one", "dp2", "r2"))
    for key in ("reward_mean", "loss", "kl_ref", "grad_norm"):
        assert [r[key] for r in r2] == [r[key] for r in one], key
    spawn(_sync_dp2_worker, 2, args=(str(tmp_path),), timeout_s=300)
    sync_dp2 = _steps(tmp_path / "sync_dp2")
    for key in ("reward_mean", "response_len", "loss", "kl_ref", "grad_norm"):
        assert [r[key] for r in dp2] == [r[key] for r in sync_dp2], key
    assert [r["reward_mean"] for r in dp2] == [r["reward_mean"] for r in one]
    assert [r["loss"] for r in dp2] == pytest.approx([r["loss"] for r in one], rel=1e-4, abs=1e-6)
    assert all("comm/dp/all_reduce/bytes" in r for r in dp2)  # the trainers' update ran over their own group
    k1 = _steps(tmp_path / "k1")
    assert [r["step"] for r in k1] == [1, 2, 3] and k1[0]["staleness/0"] == 1.0  # step 0: the initial weights
    assert all(r["staleness_max"] <= 1 and r["dropped_samples"] == 0 and r["broadcast_mb"] > 0 for r in k1)
    assert all(sum(v for k, v in r.items() if k.startswith("staleness/")) == pytest.approx(1.0) for r in k1)


def test_bad_input_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="spinwheel launch --nproc-per-node N grpo"):
        train_rl(small_config(tmp_path, rollout_ranks=1))
    with pytest.raises(ValueError, match="rollout_ranks|rollout-ranks"):
        RLConfig(rollout_ranks=0)
    with pytest.raises(ValueError, match="--rollout-ranks does not act for trpo"):
        RLConfig(algo="trpo", rollout_ranks=1)


def test_episodes_cross_ranks_unchanged():
    episodes = [
        Episode(0, 1, 17, token_ids=[1, 5, 6, 2], mask=[0, 0, 1, 1], engine_logprobs=[0.0, 0.0, -0.1234567, -2.5],
                prompt_len=2, turn_ends=[3], turn_rewards=[0.4], turn_texts=["ab"], reward=0.4, num_turns=1,
                done=True, end_reason="done", info={"x": 1.5}, drift=True, versions=[3, 4]),
        Episode(1, 0, 9, failed=True, error="reset failed: é", end_reason="failed"),
    ]  # fmt: skip
    times = {"generate": 1.25, "score": 0.5, "wait_weights": 0.0, "weight_swaps": 2.0, "kv_recomputed": 1.0}
    back, got_times = unpack_episodes(*pack_episodes(episodes, times))
    assert back == episodes and got_times == times


def test_weights_cross_in_buckets_unchanged():
    """A stream of fp32 and bf16 tensors through 64-byte buckets (tensors span buckets): every value arrives."""
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g).bfloat16(), torch.randn(40, generator=g)]
    dst = [torch.zeros_like(t) for t in src]
    sent: list[torch.Tensor] = []
    carried = broadcast_weights(src, True, lambda b: sent.append(b.clone()), bucket_mb=64 / 2**20)
    it = iter(sent)
    broadcast_weights(dst, False, lambda b: b.copy_(next(it)), bucket_mb=64 / 2**20)
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    assert carried == sum(t.numel() * t.element_size() for t in src) and max(b.numel() for b in sent) == 16
    assert len(sent) == -(-75 * 4 // 64) + 1  # fp32 stream: 300 bytes in 5 buckets; bf16: one
    assert list(buckets([3, 5], 4)) == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 4)]]
    assert BUCKET_MB == 16.0
