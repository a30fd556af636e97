"""LoRA under the parallel layouts trains exactly like one process.

The trainer: under DDP, ZeRO-1, ZeRO-2, tp 2 and pp 2 (1F1B, and GPipe with tied embeddings; with gradient
accumulation, and with clipping, weight decay and a scheduled learning rate as SFT trains), a LoRA model's per-step
losses and final adapters equal single-process
LoRA training of the same model and batches (fp32, relative 1e-5); the base is bit-for-bit unchanged, gets no
gradient, and sits in no gradient bucket or optimizer shard; each rank's optimizer state is the adapters' Adam
moments (8 bytes per element it steps: all of them under DDP, 1/dp under ZeRO, the replicated factors plus 1/tp of
the split ones under TP, its stage's under PP); with the adapters switched off the parallel forward is the base
model's.

The commands (in-process on 2 spawned ranks): ``sft --lora-rank`` under tp 2, stopped and resumed from its sharded
state, and GRPO with a KL penalty (reference: the adapters off) under ZeRO-2 give the single-process run's losses and
write its PEFT adapter; under tp 2 GRPO does too, and its per-step sync to the engine copy gathers the adapters'
split factors alone (the copy holds the frozen base). ZeRO-3 / FSDP / HSDP are refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from helpers import MAX_NORM, WEIGHT_DECAY, batches, make_model, rel_err, scheduled_lr, small_config

from spinwheel.models.lora import LoRAConfig, adapters_disabled, apply_lora, lora_parameters
from spinwheel.models.transformer import token_logprobs
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.data.zero import memory_breakdown
from spinwheel.train.lora_run import check_one_process
from spinwheel.train.optim import ADAMW_BETAS, build_adamw, decays

STEPS = 3
RTOL = 1e-5
LORA = LoRAConfig(rank=4, alpha=8.0)
LAYOUTS = [
    ("ddp-accum", dict(microbatches=2, bucket_mb=0.001)),
    ("zero1", dict(zero=1, bucket_mb=0.001)),
    ("zero2", dict(zero=2, bucket_mb=0.001)),
    ("tp2-accum-remat", dict(tp=2, microbatches=2, remat=True)),
    ("pp2-1f1b-m2", dict(pp=2, microbatches=2)),
    ("pp2-gpipe-m2-tied", dict(pp=2, schedule="gpipe", microbatches=2, tied=True)),
]


def lora_model(tied: bool) -> torch.nn.Module:
    """The fidelity tests' 4-layer model with adapters on every projection, B drawn (not zero) so that the
    adapters change the outputs from the first step."""
    model = make_model(tied)
    apply_lora(model, LORA, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def reference(tied: bool) -> dict:
    """One process: the SFT recipe (scheduled lr, decay on matrices, clipping) on the LoRA model."""
    model = lora_model(tied)
    ids, labels, _ = batches()[0]
    with torch.no_grad():
        on = token_logprobs(model(ids), labels)
        base = token_logprobs(make_model(tied)(ids), labels)
    opt = build_adamw(model, 1e-3, WEIGHT_DECAY)
    losses = []
    for step, (ids, labels, mask) in enumerate(batches()[:STEPS]):
        for group in opt.param_groups:
            group["lr"] = scheduled_lr(step)
        ce = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="none")
        loss = (ce * mask.flatten()).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    adapters = {k: v.detach().clone() for k, v in lora_parameters(model).items()}
    return {"losses": losses, "adapters": adapters, "on": on, "base": base, "tied": tied}


def _layout_worker(rank: int, world_size: int, refs: dict) -> dict:
    out = {}
    for name, kwargs in LAYOUTS:
        kwargs = dict(kwargs)
        ref = refs[kwargs.pop("tied", False)]
        model = lora_model(ref["tied"])
        base0 = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}

        def adamw(params):
            return torch.optim.AdamW(params, lr=1e-3, betas=ADAMW_BETAS, weight_decay=0.0)

        trainer = ParallelTrainer(
            model, adamw, ParallelConfig(**kwargs), max_grad_norm=MAX_NORM, weight_decay=WEIGHT_DECAY, decays=decays
        )
        ids, labels, mask = batches()[0]
        with adapters_disabled(model):
            off = trainer.forward({"input_ids": ids, "labels": labels})["logprobs"]
        on = trainer.forward({"input_ids": ids, "labels": labels})["logprobs"]
        losses = []
        for step, b in enumerate(batches()[:STEPS]):
            trainer.set_lr(scheduled_lr(step))
            losses.append(trainer.step(*b))
        mem = memory_breakdown(trainer.pm.module, trainer.optimizer)
        trainer.forward_backward(ids, labels, mask)  # gradients as the next step would see them
        module = trainer.pm.module
        frozen_grads = [n for n, p in module.named_parameters() if not p.requires_grad and p.grad is not None]
        bucketed = [p for bk in getattr(module, "buckets", getattr(module, "_buckets", [])) for p in bk.params]
        adapter_ids = {id(p) for p in lora_parameters(module).values()}
        full = trainer.full_state_dict()
        out[name] = {
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
            "adapters": max(rel_err(full[k], v) for k, v in ref["adapters"].items()),
            "base_changed": [k for k, v in base0.items() if not torch.equal(full[k], v)],
            "off": rel_err(off, ref["base"]),
            "on": rel_err(on, ref["on"]),
            "frozen_grads": frozen_grads,
            "bucketed_adapters_only": {id(p) for p in bucketed} == adapter_ids,
            "optimizer_bytes": mem["optimizer"],
            "adapter_shapes": {n: tuple(p.shape) for n, p in lora_parameters(trainer.pm.stage).items()},
        }
    return out


def expected_optimizer_bytes(name: str, shapes: dict[str, tuple[int, ...]]) -> int:
    """AdamW's two fp32 moments for every adapter element this rank steps."""
    held = sum(torch.Size(s).numel() for s in shapes.values())
    return 8 * (held // 2 if name.startswith("zero") else held)


def check_trainer_layouts(results: list[dict], refs: dict) -> None:
    n_full = sum(v.numel() for v in refs[False]["adapters"].values())
    assert all(rel_err(ref["on"], ref["base"]) > 1e-3 for ref in refs.values())  # the adapters change the outputs
    failures = []
    for rank, res in enumerate(results):
        for name, _ in LAYOUTS:
            r = res[name]
            bad = [k for k in ("loss", "adapters", "off", "on") if not r[k] <= RTOL]
            bad += ["base changed"] * bool(r["base_changed"]) + ["frozen grads"] * bool(r["frozen_grads"])
            if not name.startswith("tp") and not r["bucketed_adapters_only"]:
                bad.append("buckets hold more (or less) than the adapters")
            if r["optimizer_bytes"] != expected_optimizer_bytes(name, r["adapter_shapes"]):
                bad.append(f"optimizer bytes {r['optimizer_bytes']}")
            if bad:
                failures.append(f"{name} rank {rank}: {bad} {r}")
    assert not failures, "\n".join(failures)
    # TP holds the replicated factors whole and 1/tp of the split ones: less than all, more than half.
    tp_held = sum(torch.Size(s).numel() for s in results[0]["tp2-accum-remat"]["adapter_shapes"].values())
    assert n_full / 2 < tp_held < n_full


def test_unsupported_layouts_are_refused_in_one_line():
    config = small_config("unused", lora_rank=4)
    for kwargs, flag in [(dict(zero=3), "--zero 3"), (dict(fsdp=True), "--fsdp"), (dict(hsdp=2), "--hsdp 2")]:
        config.parallel = ParallelConfig(**kwargs)
        with pytest.raises(ValueError, match=f"^spinwheel grpo --lora-rank runs under DDP .* not {flag} "):
            check_one_process(config, True, "grpo")
    for kwargs in (dict(), dict(zero=1), dict(zero=2), dict(tp=2), dict(pp=2), dict(dp=2, tp=2, zero=1)):
        config.parallel = ParallelConfig(**kwargs)
        check_one_process(config, True, "grpo")
    config.parallel = ParallelConfig(zero=3)
    check_one_process(small_config("unused"), True, "grpo")  # full fine-tuning keeps every layout


def sft_config(out_dir, **kw):
    from spinwheel.tasks.arithmetic import ArithmeticConfig
    from spinwheel.train.sft.sft_config import SFTConfig

    base = dict(
        model="test",
        out_dir=str(out_dir),
        steps=4,
        batch_size=8,
        lr=1e-2,
        warmup_steps=1,
        grad_clip=0.5,
        eval_every=0,
        max_new_tokens=3,
        save_every=2,
        progress=False,
        num_threads=1,
        task=ArithmeticConfig(num_digits=1, num_train=40, num_test=4),
        lora_rank=4,
        lora_alpha=8,
    )
    return SFTConfig(**{**base, **kw})


RL_LORA = dict(steps=3, lora_rank=4, lora_alpha=8, beta=0.05)


def _worker(rank: int, world_size: int, refs: dict, root: str) -> dict:
    """Every layout on the trainer, then the commands: one spawned world for the whole module."""
    from spinwheel.rl.llm.loop import train_rl
    from spinwheel.train.sft.sft import train_sft

    results = _layout_worker(rank, world_size, refs)
    tp2 = ParallelConfig(tp=2)
    train_sft(sft_config(f"{root}/sft-tp2", parallel=tp2, stop_after=2))
    train_sft(sft_config(f"{root}/sft-tp2", parallel=tp2))  # resumed from step 2's sharded state
    train_rl(small_config(f"{root}/grpo-zero2", parallel=ParallelConfig(zero=2), **RL_LORA))
    train_rl(small_config(f"{root}/grpo-tp2", parallel=tp2, **RL_LORA))  # an engine copy, synced every step
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_under_layouts_trains_like_one_process(tmp_path, digit_reward):
    from safetensors.torch import load_file

    from spinwheel.models.lora_io import ADAPTER_WEIGHTS
    from spinwheel.rl.llm.loop import train_rl
    from spinwheel.train.metrics import read_metrics
    from spinwheel.train.sft.sft import train_sft

    refs = {tied: reference(tied) for tied in (False, True)}
    train_sft(sft_config(tmp_path / "sft-one"))
    train_rl(small_config(tmp_path / "grpo-one", **RL_LORA))
    results = spawn(_worker, 2, args=(refs, str(tmp_path)), timeout_s=300)
    check_trainer_layouts(results, refs)
    for one, two, key in [
        ("sft-one", "sft-tp2", "loss"),
        ("grpo-one", "grpo-zero2", "loss"),
        ("grpo-one", "grpo-tp2", "loss"),
    ]:
        ref = {r["step"]: r[key] for r in read_metrics(tmp_path / one / "metrics.jsonl") if key in r}
        got = {r["step"]: r[key] for r in read_metrics(tmp_path / two / "metrics.jsonl") if key in r}
        assert len(ref) == (4 if one == "sft-one" else 3) and got == pytest.approx(ref, rel=RTOL, abs=1e-7), two
        want = load_file(tmp_path / one / "checkpoint" / ADAPTER_WEIGHTS)  # the PEFT adapter, rank 0 gathered
        have = load_file(tmp_path / two / "checkpoint" / ADAPTER_WEIGHTS)
        assert have.keys() == want.keys() and len(want) > 0
        assert max(rel_err(have[k], v) for k, v in want.items()) <= RTOL, two
    # Under tp 2 the engine copy holds the frozen base: each step's sync gathers the split adapter factors alone.
    adapter_bytes = sum(v.numel() * 4 for v in want.values())
    steps = [r for r in read_metrics(tmp_path / "grpo-tp2" / "metrics.jsonl") if "loss" in r]
    gathered = [r["comm/tp/all_gather/bytes"] for r in steps]
    assert len(gathered) == 3 and all(0 < b < adapter_bytes for b in gathered), (gathered, adapter_bytes)
    shards = torch.load(tmp_path / "sft-tp2" / "checkpoint" / "sharded" / "rank00000.pt", weights_only=False)
    assert shards["model"] and all("lora_" in k for k in shards["model"])  # the base is not in the shards
