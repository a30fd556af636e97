"""The start-up load without the full model on any rank (issue 26, :mod:`spinwheel.parallel.io.lazy_load`).

On 2 spawned ranks, for ZeRO-3, FSDP, tp 2 (alone and with FSDP) and pp 2 (from HF checkpoints written here: one
in ``model.safetensors.index.json`` shards with untied embeddings, one tied, whose last pipeline stage copies the
embedding as its head), the lazily read model's parameters, buffers and a forward's log-probs equal the full load
+ ``parallelize`` path bit for bit, and the most parameter bytes the loader held (``load_peak_mb``) is what the
layout keeps — exactly the stage's (TP: half of each split matrix plus the replicated norms; PP: its layers) — or
for the fully sharded ones the shards plus one block of rows being read into them (each rank reads only its
shard's rows), well under the full model. In one process: a lazy model's materialised copy (an engine copy) and
its scalar-head model (a reward model or critic) equal the eager path's.
"""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.hf import load_model, save_pretrained
from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer, scalar_head_model
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.io import lazy_load
from spinwheel.parallel.io.lazy_load import load_figures, materialised_copy

VOCAB, LAYERS, MB = 64, 8, 2**20
LAYOUTS = [  # (name, checkpoint, layout)
    ("zero3", "sharded", dict(zero=3)),
    ("fsdp-tied", "tied", dict(fsdp=True)),
    ("tp2-tied", "tied", dict(tp=2)),
    ("tp2-fsdp", "sharded", dict(tp=2, fsdp=True)),
    ("pp2-tied", "tied", dict(pp=2, microbatches=2)),
]


def write_checkpoints(root) -> dict[str, str]:
    out = {}
    for name, tied in (("sharded", False), ("tied", True)):
        config = preset_config("test", VOCAB, num_hidden_layers=LAYERS, tie_word_embeddings=tied)
        model = Transformer(config).init_weights(7)
        path = root / name
        save_pretrained(model, path, shard_size_bytes=40_000 if name == "sharded" else None)
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = write_checkpoints(tmp_path_factory.mktemp("ckpt"))
    assert (tmp_path_factory.getbasetemp() / "ckpt0" / "sharded" / "model.safetensors.index.json").is_file()
    return paths


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def state(trainer: ParallelTrainer) -> dict[str, torch.Tensor]:
    module = trainer.pm.module
    return {**dict(module.named_parameters()), **{f"buffer:{n}": b for n, b in module.named_buffers()}}


def worker(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, dict]:
    lazy_load.READ_BLOCK_BYTES = 1024  # FSDP shards read 8 rows (of 32 floats) at a time: many blocks per tensor
    out = {}
    for name, ckpt, layout in LAYOUTS:
        config = ParallelConfig(**layout)
        old = ParallelTrainer(load_model(paths[ckpt]), None, config)
        model = load_model(paths[ckpt], lazy=True)
        new = ParallelTrainer(model, None, config)
        want, got = state(old), state(new)
        assert want.keys() == got.keys(), (name, sorted(want.keys() ^ got.keys()))
        unequal = [k for k in want if not torch.equal(want[k], got[k])]
        same_forward = torch.equal(old.forward(batch())["logprobs"], new.forward(batch())["logprobs"])
        held = sum(p.numel() * p.element_size() for p in {id(p): p for p in new.pm.stage.parameters()}.values())
        units = getattr(new.pm.module, "units", [])
        out[name] = {
            **load_figures(model),
            "unequal": unequal,
            "same_forward": same_forward,
            "held_mb": held / MB,  # what the layout keeps of the parameters on this rank (TP, PP)
            "shards_mb": sum(u.shard.numel() * u.shard.element_size() for u in units) / MB,
            "unit_mb": max((u.padded_numel * u.shard.element_size() for u in units), default=0) / MB,
        }
    return out


@pytest.mark.distributed
def test_lazy_load_equals_full_load_and_holds_less(checkpoints):
    results = spawn(worker, 2, args=(checkpoints,), timeout_s=240)
    for rank, by_layout in enumerate(results):
        for name, r in by_layout.items():
            assert r["unequal"] == [] and r["same_forward"], (rank, name, r["unequal"])
            assert r["model_mb"] > 0 and r["load_peak_mb"] < 0.75 * r["model_mb"], (rank, name, r)
            if r["unit_mb"]:  # fully sharded: the shards kept, plus (less than) one unit's piece being read
                assert r["shards_mb"] <= r["load_peak_mb"] <= r["shards_mb"] + r["unit_mb"], (rank, name, r)
            else:  # TP / PP: exactly the slices and layers the rank keeps, nothing more at any time
                assert r["load_peak_mb"] == pytest.approx(r["held_mb"], rel=1e-12), (rank, name, r)
    tp, zero3 = results[0]["tp2-tied"], results[0]["zero3"]
    assert tp["load_peak_mb"] < 0.55 * tp["model_mb"]  # 1/2 of every matrix (tied head = embedding) + the norms
    assert zero3["load_peak_mb"] < 0.6 * zero3["model_mb"]  # 1/2 of the flat units + the largest piece read


def test_materialised_copy_and_scalar_head_equal_the_full_load(checkpoints):
    for path in checkpoints.values():
        eager, lazy = load_model(path), load_model(path, lazy=True)
        assert all(p.is_meta for p in lazy.parameters()) and load_figures(eager) == {}
        want, got = eager.state_dict(), materialised_copy(lazy).state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        head_want = scalar_head_model(eager, seed=3).state_dict()
        head_got = materialised_copy(scalar_head_model(lazy, seed=3)).state_dict()
        assert head_want.keys() == head_got.keys() and all(torch.equal(head_want[k], head_got[k]) for k in head_want)
