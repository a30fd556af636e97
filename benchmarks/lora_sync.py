"""Adapter-only weight sync vs the full-weight sync, per update, to an engine that holds its own copy of the policy
(the ``--max-staleness`` producer's): bytes and seconds, and that both engines then generate the same tokens.

    python benchmarks/lora_sync.py [--model small] [--rank 8] [--updates 20] [--run-steps 4]

1. **Engine level.** A LoRA policy (``--rank``, every projection) and two engine copies of it: one keeps its LoRA
   layers and receives the adapters alone after each update (:func:`~spinwheel.rl.llm.rollouts.weight_sync.sync_state`,
   loaded in place, unmerged); the other is a plain copy of the base that receives every weight of the merged model
   (W + s·B·A folded in on the trainer's side, then copied), which is what an engine without LoRA layers needs. Each
   "update" moves every adapter factor (random steps, as AdamW moves them). Median seconds of the trainer's side
   (what is copied out: clone, plus the merge for the full sync) and of the engine's side (``update_weights``: the
   copy in and the prefix-cache drop), and the greedy tokens of both engines on a few prompts after the last update.
2. **In a run.** ``--run-steps`` GRPO steps with ``--max-staleness 1`` on the built-in task, LoRA vs full
   fine-tuning: the ``sync_bytes``, ``sync_load_s`` and ``time/sync`` each run logs in ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models.hf import load_model
from spinwheel.models.lora import LoRAConfig, apply_lora, lora_layers, lora_parameters
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.rl.llm.rollouts.weight_sync import state_bytes, sync_state

PROMPTS = ["12+34=", "70+59=", "99+99=", "5+68="]


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` with its adapters folded in (W + s B A), as a plain model's state dict."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k and "rotary." not in k}
    for name, layer in lora_layers(model).items():
        state[f"{name}.weight"] += layer.delta_weight().detach()
    return state


def engine_level(args, tokenizer) -> None:
    policy = load_model(args.model, seed=args.seed, vocab_size=tokenizer.vocab_size)
    plain_base = copy.deepcopy(policy).requires_grad_(False)
    apply_lora(policy, LoRAConfig(rank=args.rank, alpha=2.0 * args.rank), seed=args.seed)
    options = dict(max_model_len=64, seed=args.seed, cpu_packed_weights=False)  # as the RL loop's engines
    adapter_engine = LLM(copy.deepcopy(policy).requires_grad_(False), tokenizer, **options)
    full_engine = LLM(plain_base, tokenizer, **options)
    gen = torch.Generator().manual_seed(args.seed)
    times: dict[str, list[float]] = {k: [] for k in ("adapter_out", "adapter_in", "full_out", "full_in")}
    for _ in range(args.updates):
        with torch.no_grad():
            for p in lora_parameters(policy).values():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        t0 = time.perf_counter()
        adapters = sync_state(policy)
        t1 = time.perf_counter()
        adapter_engine.update_weights(adapters)
        t2 = time.perf_counter()
        full = merged_state(policy)
        t3 = time.perf_counter()
        full_engine.update_weights(full)
        t4 = time.perf_counter()
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[key].append(seconds)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(*(
        e.generate(PROMPTS, greedy) for e in (adapter_engine, full_engine)
    ))]  # fmt: skip
    a_mb, f_mb = state_bytes(adapters) / 2**20, state_bytes(full) / 2**20
    print(f"engine level ({args.model}, LoRA r={args.rank} on every projection, {args.updates} updates, medians):")
    print(
        f"  adapter-only sync: {a_mb:.3f} MiB, out {med['adapter_out']:.2f} ms + in {med['adapter_in']:.2f} ms "
        f"= {med['adapter_out'] + med['adapter_in']:.2f} ms"
    )
    print(
        f"  full merged sync:  {f_mb:.3f} MiB, merge+out {med['full_out']:.2f} ms + in {med['full_in']:.2f} ms = "
        f"{med['full_out'] + med['full_in']:.2f} ms"
    )
    total = (med["adapter_out"] + med["adapter_in"]) / (med["full_out"] + med["full_in"])
    print(f"  ratio adapter / full: bytes {a_mb / f_mb:.3f}, seconds {total:.3f}")
    print(f"  greedy tokens equal after the last update: {sum(same)}/{len(same)} prompts")


def in_run(args) -> None:
    from spinwheel.rl.llm import RLConfig, train_rl

    print(f"in a run ({args.model}, GRPO --max-staleness 1, {args.run_steps} steps of 8 x 8, medians):")
    for label, lora in (("LoRA", dict(lora_rank=args.rank, lora_alpha=2.0 * args.rank)), ("full FT", {})):
        with tempfile.TemporaryDirectory() as out:
            config = RLConfig(
                model=args.model, out_dir=out, steps=args.run_steps, prompts_per_step=8, group_size=8,
                max_new_tokens=8, max_staleness=1, lr=1e-4, eval_every=0, eval_examples=8, save_every=0,
                progress=False, num_threads=args.threads, seed=args.seed, resume=False, **lora,
            )  # fmt: skip
            history = train_rl(config)["history"]
        rows = [r for r in history if "sync_bytes" in r]
        loads = [r["sync_load_s"] for r in rows if r.get("sync_load_s")]
        print(
            f"  {label:>7}: sync_bytes {rows[-1]['sync_bytes'] / 2**20:.3f} MiB per update, time/sync (trainer's "
            f"copy) {1e3 * statistics.median(r['time/sync'] for r in rows):.2f} ms, sync_load_s (engine) "
            f"{1e3 * statistics.median(loads) if loads else float('nan'):.2f} ms ({len(loads)} swaps)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--run-steps", type=int, default=4, help="GRPO steps per run (0: skip the in-run part)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    engine_level(args, tokenizer)
    if args.run_steps:
        in_run(args)


if __name__ == "__main__":
    main()
