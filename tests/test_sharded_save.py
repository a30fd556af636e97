"""Streamed consolidated saves (issue 26, spinwheel/parallel/io/streamed_save.py): on 2 spawned ranks under ZeRO-3,
FSDP, HSDP, TP 2 and PP 2, ``save_hf`` writes ``model.safetensors`` tensor by tensor without any rank holding the model.

Reference: today's gathering path — :func:`full_state_dict` on every rank, a full ``Transformer`` on rank 0 written
by ``save_pretrained``. The streamed file equals that file byte for byte (header, names, dtypes, data), loads with
``safetensors.torch.load_file`` and :func:`~spinwheel.models.hf.load_model` to exactly ``full_state_dict``'s tensors,
and each rank's peak of materialised bytes stays at one tensor (TP: and one slice), never the model. A
:class:`ParallelLearner` checkpoint under ZeRO-3 streams too, holds what the gathering save writes (HF files and
trainer state byte for byte, the same shard files) and resumes to the same shards."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import torch
from helpers import make_model, optimizer_factory
from safetensors.torch import load_file

from spinwheel.models.hf import hf_tensor_name, load_model, save_pretrained
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.io.checkpoint import full_state_dict, save_hf

LAYOUTS = [
    ("zero3", dict(zero=3), False),
    ("fsdp-tied", dict(fsdp=True), True),
    ("hsdp-replicas", dict(hsdp=1), False),  # shard groups of 1, 2 replicas: replica 1 takes no part
    ("tp2-tied", dict(tp=2), True),
    ("pp2", dict(pp=2, microbatches=2), False),
]


def save_layouts(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, kwargs, tied in LAYOUTS:
        trainer = ParallelTrainer(make_model(tied), optimizer_factory, ParallelConfig(**kwargs))
        full = full_state_dict(trainer.pm)  # today's gather: the reference
        stats = save_hf(trainer.pm, f"{root}/{name}/streamed")
        if rank == 0:
            model = Transformer(trainer.model_config)
            model.load_state_dict(full)
            save_pretrained(model, f"{root}/{name}/gathered")
            full = {k: v for k, v in full.items() if hf_tensor_name(k, model.config) is not None}
            torch.save(full, f"{root}/{name}/full.pt")
        out[name] = stats
    out["learner"] = learner_checkpoints(rank, root)
    Path(f"{root}/a-file").touch()
    try:  # rank 0 cannot write there: every rank gets its error before any tensor moves
        save_hf(trainer.pm, f"{root}/a-file/hf")
    except OSError as e:
        out["unwritable"] = str(e)
    return out


def learner_checkpoints(rank: int, root: str) -> tuple:
    """A ZeRO-3 learner's streamed checkpoint and the gathering one of the same weights; the streamed one resumed."""
    from spinwheel.train.learners import OptimConfig, ParallelLearner
    from spinwheel.train.parallel_checkpoint import save_gathered

    def learner(seed: int) -> ParallelLearner:
        model = make_model(False).init_weights(seed=seed)
        return ParallelLearner(model, OptimConfig(lr=1e-3), ParallelConfig(zero=3), engine_copy="none")

    first = learner(1)
    first.save(Path(root) / "ckpt-streamed", None, {"step": 1})
    save_gathered(first, Path(root) / "ckpt-gathered", None, {"step": 1})
    second = learner(99)  # other weights: everything must come from the checkpoint
    second.load(Path(root) / "ckpt-streamed", None)
    pairs = zip(first.trainer.pm.module.parameters(), second.trainer.pm.module.parameters())
    same = all(torch.equal(a, b) for a, b in pairs)
    return first.save_stats, same


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_save")
    return root, spawn(save_layouts, 2, args=(str(root),), timeout_s=120)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS])
def test_streamed_file_equals_todays_save(saved, name):
    root, _ = saved
    streamed, gathered = root / name / "streamed", root / name / "gathered"
    for f in ("model.safetensors", "config.json"):
        assert filecmp.cmp(streamed / f, gathered / f, shallow=False), f"{name}: {f} differs from save_pretrained's"
    full = torch.load(root / name / "full.pt")
    model = load_model(streamed)
    tied = model.config.tie_word_embeddings
    loaded = load_file(streamed / "model.safetensors")
    assert len(loaded) == len(full)
    for key, ref in full.items():
        assert torch.equal(loaded[hf_tensor_name(key, model.config)], ref), key
        assert torch.equal(model.state_dict()[key], ref), key
    if tied:
        assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.distributed
@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS])
def test_no_rank_materialises_the_model(saved, name):
    """Peak bytes beyond each rank's own shards: ZeRO-3/FSDP the largest tensor on the rank that assembles them
    (nothing on the other); TP one tensor and one slice; PP one received tensor on rank 0, nothing on the sending
    stage. Gathering a whole unit (or the model) first fails here."""
    root, results = saved
    full = torch.load(root / name / "full.pt")
    biggest = max(t.numel() * t.element_size() for t in full.values())
    s0, s1 = results[0][name], results[1][name]
    assert s0.model_bytes == s1.model_bytes == sum(t.numel() * t.element_size() for t in full.values())
    assert s0.peak_bytes < s0.model_bytes / 2, (name, s0)
    if name.startswith(("zero3", "fsdp", "hsdp")):
        assert s0.peak_bytes == biggest and s1.peak_bytes == 0, (name, s0, s1, biggest)
    elif name.startswith("tp"):
        assert biggest <= s0.peak_bytes <= 1.5 * biggest and s1.peak_bytes == 0, (name, s0, s1, biggest)
    else:
        assert 0 < s0.peak_bytes <= biggest and s1.peak_bytes == 0, (name, s0, s1, biggest)


@pytest.mark.distributed
def test_learner_checkpoint_streams_and_resumes(saved):
    root, results = saved
    stats, same = results[0]["learner"]
    streamed, gathered = root / "ckpt-streamed", root / "ckpt-gathered"
    for f in ("model.safetensors", "config.json", "trainer_state.pt"):
        assert filecmp.cmp(streamed / f, gathered / f, shallow=False), f
    assert sorted(p.name for p in (streamed / "sharded").iterdir()) == sorted(
        p.name for p in (gathered / "sharded").iterdir()
    )
    assert len(stats) == 2 and all(f["save_peak_mb"] < f["save_model_mb"] / 2 for f in stats), stats
    assert all(r["learner"][1] for r in results), "the streamed checkpoint did not resume to the same shards"


@pytest.mark.distributed
def test_an_unwritable_path_fails_in_one_line_on_every_rank(saved):
    root, results = saved
    errors = [r.get("unwritable") for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("cannot write the checkpoint:") and str(root / "a-file") in errors[0], errors[0]
    assert "\n" not in errors[0]


@pytest.mark.distributed
def test_the_harness_logs_each_ranks_peak_beside_the_models_bytes(saved, tmp_path):
    """``Run.save`` writes a streamed save's figures (the ZeRO-3 learner's above) to ``metrics.jsonl``."""
    from spinwheel.train.metrics import read_metrics
    from spinwheel.train.run import Run
    from spinwheel.train.sft.sft_config import SFTConfig

    stats = saved[1][0]["learner"][0]

    class Job:  # what Run.save reads of a job and its learner
        class learner:  # noqa: N801
            save_stats = stats
            params_finite = staticmethod(lambda: True)

        def save(self, ckpt_dir: Path, state: dict) -> None:
            pass

    with Run(SFTConfig(model="test", out_dir=str(tmp_path), steps=3, progress=False), False, "test") as run:
        run.open_log(True)
        run.save(Job(), 3)
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {
            "step": 3,
            "save_model_mb": stats[0]["save_model_mb"],
            "save_s": stats[0]["save_s"],
            "save_peak_mb/rank0": stats[0]["save_peak_mb"],
            "save_peak_mb/rank1": 0.0,
        }
    ]
    assert 0 < stats[0]["save_peak_mb"] < stats[0]["save_model_mb"] / 2
