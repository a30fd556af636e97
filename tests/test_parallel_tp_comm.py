"""Tensor-parallel communication volume, from the comm counters (Megatron-LM §3: two all-reduces forward and two
backward per block, each of the activation (B, T, C)), and the counters as users see them in ``metrics.jsonl``
(``spinwheel launch --nproc-per-node 2 sft --tp 2``).

Per training step under tp=2 with L blocks, batch B, T tokens and hidden size C, every tensor-parallel collective
is an all-reduce:

* forward: the vocab-parallel embedding's ``g`` (B, T, C); per block ``g`` after ``o_proj`` and after ``down_proj``
  (B, T, C) each; the vocab-parallel cross-entropy's max (B·T,) and partition function with target logit (2, B·T);
* backward: ``f`` before the column-parallel head (B, T, C), then per block ``f`` before the MLP and before attention
  (B, T, C) each — q, k, v share one ``f``, gate and up another. With re-materialisation each block's whole
  forward runs again during backward (the checkpoint region recomputes every block call it covers), so both of
  its ``g`` all-reduces run again: 2L more, as in Megatron's full recompute.

ZeRO accounting counts an all-reduce of Ψ elements as 2Ψ, so the step's bytes are
``2 · 4 · ((4L + 2)·B·T·C + 3·B·T)`` in fp32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import Comm, ParallelConfig, ParallelDims, ParallelTrainer, spawn
from spinwheel.parallel.trainer import nll_loss
from spinwheel.train.metrics import read_metrics

VOCAB, BATCH, SEQ, LAYERS = 64, 4, 10, 3


class RecordingComm(Comm):
    """A :class:`Comm` that also logs every counted collective as (axis, op, tensor shape), in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, tuple[int, ...]]] = []

    def _count(self, op, axis, elements, t) -> None:
        super()._count(op, axis, elements, t)
        if axis.size > 1:
            self.log.append((axis.name, op, tuple(t.shape)))


def _tp_step(config, batch: dict, remat: bool) -> dict:
    """One tp=2 training step; the collectives of its forward (up to the loss) and of its backward."""
    comm = RecordingComm()
    dims = ParallelDims.create(tp=2, comm=comm)
    model = Transformer(config).init_weights(seed=0)
    trainer = ParallelTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ParallelConfig(tp=2, remat=remat), dims)
    comm.log.clear()
    comm.stats.reset()
    forward_calls: list[int] = []

    def loss_fn(outputs, mb):
        forward_calls.append(len(comm.log))  # the forward and the loss's reductions are done when the loss is taken
        return nll_loss(outputs, mb)

    trainer.train_step(batch, loss_fn)
    (n,) = forward_calls
    return dict(forward=comm.log[:n], backward=comm.log[n:], metrics=comm.stats.metrics())


def _step_log(rank: int, world_size: int) -> dict:
    config = preset_config("test", VOCAB, num_hidden_layers=LAYERS)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "weights": torch.full((BATCH, SEQ), 1 / BATCH / SEQ)}
    out: dict = {remat: _tp_step(config, batch, remat) for remat in (False, True)}

    # Data parallelism on the same two ranks: DDP all-reduces every gradient once (2Ψ), on the dp axis.
    comm = Comm()
    dims = ParallelDims.create(comm=comm)
    model = Transformer(config).init_weights(seed=0)
    trainer = ParallelTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ParallelConfig(), dims)
    comm.stats.reset()
    trainer.train_step(batch, nll_loss)
    out["ddp"] = dict(metrics=comm.stats.metrics(), num_params=sum(p.numel() for p in model.parameters()))
    return out


@pytest.fixture(scope="module")
def logs():
    return spawn(_step_log, 2, timeout_s=180)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_all_reduces_forward_and_backward_per_block(logs):
    c = preset_config("test", VOCAB).hidden_size
    act = ("tp", "all_reduce", (BATCH, SEQ, c))
    for res in logs:  # both ranks
        got = res[False]
        assert got["forward"] == [act] * (1 + 2 * LAYERS) + [
            ("tp", "all_reduce", (BATCH * SEQ,)),
            ("tp", "all_reduce", (2, BATCH * SEQ)),
        ]
        assert got["backward"] == [act] * (2 * LAYERS + 1)
        elements = (4 * LAYERS + 2) * BATCH * SEQ * c + 3 * BATCH * SEQ
        assert got["metrics"] == {"comm/tp/all_reduce/calls": 4 * LAYERS + 4, "comm/tp/all_reduce/bytes": 8 * elements}


@pytest.mark.slow
@pytest.mark.distributed
def test_remat_reruns_the_forward_reductions_in_backward(logs):
    c = preset_config("test", VOCAB).hidden_size
    act = ("tp", "all_reduce", (BATCH, SEQ, c))
    for res in logs:
        got = res[True]
        assert got["forward"] == res[False]["forward"]
        assert got["backward"] == [act] * (4 * LAYERS + 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_counters_are_on_the_dp_axis(logs):
    ddp = logs[0]["ddp"]
    assert set(ddp["metrics"]) == {"comm/dp/all_reduce/calls", "comm/dp/all_reduce/bytes"}
    assert ddp["metrics"]["comm/dp/all_reduce/bytes"] == 2 * 4 * ddp["num_params"]
    assert ddp["metrics"]["comm/dp/all_reduce/calls"] >= 1


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_sft_logs_each_steps_collectives(tmp_path):
    # Every example has the same length, so each step's batch is (B, T) with T known in advance.
    prompt, completion = "12+34=", "46"
    line = json.dumps({"prompt": prompt, "completion": completion}) + "\n"
    (tmp_path / "data.jsonl").write_text(line * 12)
    tok = load_tokenizer("test")
    # BOS + prompt + completion + EOS, less one: the trainer's inputs are shifted by a token.
    seq = len(tok.encode(prompt)) + len(tok.encode(completion, add_special_tokens=False))
    batch, steps = 4, 2
    cmd = [sys.executable, "-m", "spinwheel", "launch", "--standalone", "--nproc-per-node", "2"]
    cmd += ["sft", "--model", "test", "--data", str(tmp_path / "data.jsonl"), "--steps", str(steps)]
    cmd += ["--batch-size", str(batch), "--tp", "2", "--eval-examples", "1", "--max-new-tokens", "2", "--no-progress"]
    cmd += ["--num-threads", "1", "--out-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    config = preset_config("test", tok.vocab_size)
    layers, c = config.num_hidden_layers, config.hidden_size
    elements = (4 * layers + 2) * batch * seq * c + 3 * batch * seq
    for r in records:
        comm = {k: v for k, v in r.items() if k.startswith("comm/")}
        assert comm == {"comm/tp/all_reduce/calls": 4 * layers + 4, "comm/tp/all_reduce/bytes": 8 * elements}, r
