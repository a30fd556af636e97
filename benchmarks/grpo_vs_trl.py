"""GRPO step time and learning: TRL's ``GRPOTrainer`` vs spinwheel's GRPO, side by side in one process, on the same
model, prompts, reward, seed and hyper-parameters.

    python benchmarks/grpo_vs_trl.py --model runs/demo/checkpoint [--steps 200] [--threads 2]
    python benchmarks/grpo_vs_trl.py --model small --max-new-tokens 64 --steps 30 --lr 1e-5   # generation-heavier

``--model`` is a spinwheel checkpoint in HF format (TRL loads it with ``AutoModelForCausalLM`` and the char
tokenizer as ``PreTrainedTokenizerFast``) or a preset, saved first with random weights (seed ``--seed``).

Matched settings (TRL name ↔ spinwheel option): ``num_generations`` ↔ ``--group-size``; ``per_device_train_batch_
size`` = prompts × G ↔ ``--prompts-per-step`` (one optimizer step per rollout: ``num_iterations`` = 1 ↔
``--epochs 1 --minibatches 1``); ``max_completion_length`` ↔ ``--max-new-tokens``; ``learning_rate`` (constant,
no warmup) ↔ ``--lr``; AdamW β₂ 0.95 (spinwheel's) in both, weight decay 0, gradient clip 1.0; ``beta`` ↔
``--beta`` with TRL's k3 estimator; ``epsilon`` ↔ ``--eps-low/--eps-high``; temperature 1, top-p 1, no top-k;
fp32 in both (TRL's own defaults would be bf16 autocast and activation checkpointing: both off here);
``loss_type="dapo"`` (TRL's default: Σ over all completion tokens / their number, on one process) ↔
``--loss-agg token-mean``; ``scale_rewards="group"`` ↔ ``--scale-rewards`` (TRL divides by std + 1e-4,
spinwheel by std + 1e-6: with G 8 and 0/1 rewards a group with std > 0 has std ≥ 0.35, so the advantages differ
by < 3e-4 relative).
Prompts: the arithmetic task's train split, the *same prompts at every step* (TRL's dataset is laid out in the
order spinwheel's seeded sampler visits it, unshuffled). Reward: exact match (``spinwheel.tasks.arithmetic.reward``).

Timing: the two trainers run in two threads that take turns one step at a time (TRL step 1, spinwheel step 1,
TRL step 2, …; set-up runs in turn too), so load on the shared machine hits both alike and their steps never
overlap. A step's wall time runs from taking the turn to handing it on at the next step boundary (spinwheel: its
loop's iterations; TRL: ``on_step_end``), so each system's own per-step bookkeeping and logging are inside it; the
first step (warm-up) is left out and the median is reported, with the process CPU time of the same steps (the work
done, whatever the load; with one thread it is the step's compute). Phases: spinwheel's own ``time/*`` metrics;
TRL's from timers wrapped around its methods (``_generate``, ``_calculate_rewards``, no-grad
``_get_per_token_logps_and_entropies``; "prepare" is the rest of ``_prepare_inputs``: padding, advantages, metrics,
shuffling; "fwd+bwd" the rest of ``training_step``; "optim+rest" the rest of the step: clip, optimizer, logging).
Learning: the mean sampled reward over the last ``--last`` steps, and for each final policy (spinwheel's engine,
the same held-out examples) the greedy exact match and the mean reward of ``--eval-samples`` completions per prompt
at temperature 1 — the reward GRPO maximises, on ``eval_examples × eval_samples`` completions (8,000 by default),
so far less noisy than the last steps' ``last × prompts × G``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

import spinwheel.train.run as run_harness
from spinwheel.engine import LLM, SamplingParams
from spinwheel.engine.config import EngineConfig
from spinwheel.models.hf import load_model
from spinwheel.models.presets import PRESETS
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.rl.llm import RLConfig, train_rl
from spinwheel.rl.llm.rollout import prompts_from_task
from spinwheel.tasks.arithmetic import ArithmeticTask, evaluate, reward
from spinwheel.train.checkpoint import save_checkpoint
from spinwheel.train.optim import ADAMW_BETAS, ADAMW_EPS
from spinwheel.train.sft.sft_data import batch_indices

SYSTEMS = ("trl", "spinwheel")


class Baton:
    """Two threads take turns: ``take`` blocks until it is the caller's turn (or the other has left), ``hand_on``
    gives the turn to the other (for good with ``leave``)."""

    def __init__(self) -> None:
        self.turn, self.left, self.cv = SYSTEMS[0], set[str](), threading.Condition()

    def take(self, name: str) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == name or SYSTEMS[1 - SYSTEMS.index(name)] in self.left)

    def hand_on(self, name: str, leave: bool = False) -> None:
        with self.cv:
            if leave:
                self.left.add(name)
            self.turn = SYSTEMS[1 - SYSTEMS.index(name)]
            self.cv.notify_all()


@dataclass
class Run:
    """One system's run: per-step wall times (s), per-step phase times (s) and sampled rewards."""

    name: str
    baton: Baton
    step_times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    rewards: list[float] = field(default_factory=list)
    eval_after: float | None = None
    sampled_after: float | None = None
    started: tuple[float, float] = (0.0, 0.0)  # (wall, process CPU) at the start of the step

    def start(self) -> None:
        self.started = (time.perf_counter(), time.process_time())

    def end(self) -> None:
        self.step_times.append(time.perf_counter() - self.started[0])
        self.cpu_times.append(time.process_time() - self.started[1])

    def boundary(self) -> None:
        """A step ended: record it, let the other system run a step, then start timing the next one."""
        self.end()
        self.baton.hand_on(self.name)
        self.baton.take(self.name)
        self.start()


def prepare_checkpoint(args, work: Path) -> Path:
    """The checkpoint both systems start from: ``--model`` itself, or a preset saved with random weights."""
    if args.model not in PRESETS or Path(args.model).exists():
        return Path(args.model)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, seed=args.seed, vocab_size=tokenizer.vocab_size)
    return save_checkpoint(work / f"{args.model}-init", model, tokenizer)


def heldout_scores(ckpt: Path, args) -> tuple[float, float]:
    """A final policy on the task's held-out split, on spinwheel's engine: greedy exact match, and the mean reward
    of ``--eval-samples`` completions per prompt at temperature 1 (the quantity GRPO raises, measured on
    ``eval_examples × eval_samples`` completions instead of the last steps' few hundred; the same seed for both
    systems' policies, so the two share the sampler's random numbers)."""
    tokenizer = load_tokenizer(ckpt)
    model = load_model(ckpt, dtype="float32")
    examples = prompts_from_task(tokenizer, ArithmeticTask().test[: args.eval_examples])
    ids = {p.text: list(p.ids) for p in examples}
    llm = LLM(model, tokenizer, max_model_len=max(len(p.ids) for p in examples) + args.max_new_tokens + 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    result = evaluate(
        lambda texts: [o.outputs[0].text for o in llm.generate([ids[t] for t in texts], greedy)],
        examples,
        batch_size=len(examples),
    )
    sampled = SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens, n=args.eval_samples, seed=args.seed)
    outs = llm.generate([list(p.ids) for p in examples], sampled)
    values = [reward(c.text, p.answer) for o, p in zip(outs, examples) for c in o.outputs]
    llm.close()
    return result.exact_match, statistics.fmean(values)


class _SteppedBar:
    """Stands in for the loop's progress bar: each iteration of the step loop is a step boundary."""

    def __init__(self, run: Run, steps, **_) -> None:
        self.run, self.steps = run, steps

    def __iter__(self):
        for i, step in enumerate(self.steps):
            if i:
                self.run.boundary()
            else:
                self.run.start()
            yield step
        self.run.end()
        self.run.baton.hand_on(self.run.name, leave=True)  # saving, the final evaluation and plotting are not timed

    def set_postfix(self, *a, **k) -> None:
        pass

    def write(self, text: str) -> None:
        print(text)

    def close(self) -> None:
        pass


def run_spinwheel(args, ckpt: Path, work: Path, run: Run) -> None:
    config = RLConfig(
        algo="grpo",
        model=str(ckpt),
        out_dir=str(work / "spinwheel"),
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        epochs=1,
        minibatches=1,
        lr=args.lr,
        grad_clip=1.0,
        beta=args.beta,
        kl_estimator="k3",
        eps_low=args.epsilon,
        eps_high=args.epsilon,
        loss_agg="token-mean",
        scale_rewards=True,
        eval_every=0,
        eval_examples=args.eval_examples,
        save_every=0,
        seed=args.seed,
        resume=False,
        num_threads=args.threads,
        progress=False,
        engine=EngineConfig(cpu_packed_weights=args.engine_cpu_packed_weights),  # default: the loop's (unpacked)
    )
    run_harness.tqdm = lambda steps, **k: _SteppedBar(run, steps, **k)  # the harness draws the step loop
    result = train_rl(config)
    for record in result["history"]:
        run.rewards.append(record["reward_mean"])
        for key, value in record.items():
            if key.startswith("time/"):
                run.phases[key[5:]].append(value)


def matched_config(args, work: Path, max_completion_length: int):
    """TRL's ``GRPOConfig`` with every setting matched to spinwheel's (module docstring), fp32 on the CPU."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(work / "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=max_completion_length,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=ADAMW_BETAS[0],
        adam_beta2=ADAMW_BETAS[1],
        adam_epsilon=ADAMW_EPS,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        epsilon=args.epsilon,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # TRL's defaults: bf16 autocast, recomputation
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run_trl(args, ckpt: Path, work: Path, run: Run):
    """TRL's run; returns the trainer (its held-out evaluation runs after both runs ended)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(ckpt, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for cfg in (model.config, model.generation_config):  # spinwheel's config.json carries no special ids yet
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
    train = prompts_from_task(load_tokenizer(ckpt), ArithmeticTask().train)
    order = [i for step in range(args.steps) for i in batch_indices(step, args.prompts, len(train), args.seed)]
    rows = [train[i] for i in order]
    probe = tokenizer(text=[p.text for p in rows[: args.prompts]])["input_ids"]
    if [list(p.ids) for p in rows[: args.prompts]] != probe:
        raise SystemExit("TRL's tokenizer does not give spinwheel's prompt ids (BOS?): the runs would differ")
    dataset = Dataset.from_dict({"prompt": [p.text for p in rows], "answer": [p.answer for p in rows]})

    def exact_match(prompts, completions, answer, **_):
        values = [reward(c, a) for c, a in zip(completions, answer)]
        run.rewards.append(sum(values) / len(values))
        return values

    config = matched_config(args, work, args.max_new_tokens)
    trainer = GRPOTrainer(
        model=model, reward_funcs=exact_match, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.remove_callback(PrinterCallback)
    acc: dict[str, float] = defaultdict(float)

    def timed(name: str, phase: str, only_no_grad: bool = False) -> None:
        fn = getattr(trainer, name)

        def wrapper(*a, **k):
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[phase] += time.perf_counter() - t0

        setattr(trainer, name, wrapper)

    timed("_generate", "generate")
    timed("_calculate_rewards", "score")
    timed("_get_per_token_logps_and_entropies", "logprobs", only_no_grad=True)
    timed("_prepare_inputs", "inputs")
    timed("training_step", "training_step")

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            run.start()

        def on_step_end(self, *a, **k):
            wall = time.perf_counter() - run.started[0]
            inner = acc["generate"] + acc["score"] + acc["logprobs"]
            split = {
                "generate": acc["generate"],
                "score": acc["score"],
                "logprobs": acc["logprobs"],
                "prepare": acc["inputs"] - inner,
                "fwd+bwd": acc["training_step"] - acc["inputs"],
                "optim+rest": wall - acc["training_step"],
            }
            for key, value in split.items():
                run.phases[key].append(value)
            acc.clear()
            run.boundary()

    trainer.add_callback(StepClock())
    torch.manual_seed(args.seed)
    try:
        trainer.train()
    finally:
        run.baton.hand_on(run.name, leave=True)
    return trainer


def run_both(args, ckpt: Path, work: Path) -> dict[str, Run]:
    """Both trainers in turns (see the module docstring); TRL's final policy is evaluated afterwards."""
    baton = Baton()
    runs = {name: Run(name, baton) for name in SYSTEMS}
    out: dict[str, object] = {}

    def target(name: str, fn) -> None:
        torch.set_num_threads(args.threads)  # OpenMP's thread count is per thread: a new thread has the default
        baton.take(name)
        try:
            out[name] = fn(args, ckpt, work, runs[name])
        except BaseException as e:  # noqa: BLE001 — re-raised in the main thread
            out[name] = e
        finally:
            baton.hand_on(name, leave=True)

    threads = [
        threading.Thread(target=target, args=(name, fn), name=name)
        for name, fn in (("trl", run_trl), ("spinwheel", run_spinwheel))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for value in out.values():
        if isinstance(value, BaseException):
            raise value
    final = work / "trl-final"
    out["trl"].model.save_pretrained(final)  # type: ignore[attr-defined]
    load_tokenizer(ckpt).save_pretrained(final)
    for name, path in (("trl", final), ("spinwheel", work / "spinwheel" / "checkpoint")):
        runs[name].eval_after, runs[name].sampled_after = heldout_scores(path, args)
    for run in runs.values():  # leave out the first step: warm-up (first packing, allocator, lazy imports)
        run.step_times, run.cpu_times = run.step_times[1:], run.cpu_times[1:]
    return runs


def print_phases(run: Run) -> None:
    total = statistics.median(run.step_times)
    parts = {k: statistics.median(v[1:]) for k, v in run.phases.items()}
    if run.name == "spinwheel":
        parts["rest"] = max(0.0, total - sum(parts.values()))
    text = ", ".join(f"{k} {1e3 * v:.1f} ms ({100 * v / total:.0f}%)" for k, v in parts.items())
    print(f"  {run.name:>9} phases (medians): {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/demo/checkpoint", help="spinwheel HF checkpoint dir or preset")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--last", type=int, default=50, help="steps the final mean reward is taken over")
    parser.add_argument("--eval-examples", type=int, default=500)
    parser.add_argument("--eval-samples", type=int, default=16, help="sampled completions per held-out prompt")
    parser.add_argument(
        "--engine-cpu-packed-weights",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="spinwheel's engine option of that name (off by default in the RL loop: repacked after every update)",
    )
    parser.add_argument("--work-dir", default=None, help="where runs write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl-") as tmp:
        work = Path(args.work_dir or tmp)
        ckpt = prepare_checkpoint(args, work)
        model = load_model(ckpt)
        print(
            f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
            f"{model.config.num_hidden_layers} layers × {model.config.hidden_size}, fp32; threads "
            f"{torch.get_num_threads()}; torch {torch.__version__}"
        )
        print(
            f"workload: {args.steps} steps × {args.prompts} prompts × G {args.group_size}, completions ≤ "
            f"{args.max_new_tokens} tokens, lr {args.lr}, β {args.beta}, ε {args.epsilon}, seed {args.seed}"
        )
        t0 = time.perf_counter()
        runs = run_both(args, ckpt, work)
        print(f"  both runs in turns: {time.perf_counter() - t0:.1f} s", flush=True)
    med = {name: (statistics.median(r.step_times), statistics.median(r.cpu_times)) for name, r in runs.items()}
    last = {name: statistics.fmean(r.rewards[-args.last :]) for name, r in runs.items()}
    for name, run in runs.items():
        print(
            f"  {name:>9}: {1e3 * med[name][0]:.1f} ms/step median ({1e3 * statistics.fmean(run.step_times):.1f} "
            f"mean; CPU {1e3 * med[name][1]:.1f} ms/step); sampled reward first {args.last} steps "
            f"{statistics.fmean(run.rewards[: args.last]):.3f} → last {args.last} {last[name]:.3f}; held-out "
            f"greedy exact match after {run.eval_after:.3f}, sampled reward after {run.sampled_after:.4f}"
        )
    for run in runs.values():
        print_phases(run)
    print(
        f"spinwheel / TRL step time: {med['spinwheel'][0] / med['trl'][0]:.3f} (target ≤ 0.5; CPU time "
        f"{med['spinwheel'][1] / med['trl'][1]:.3f}); last-{args.last} reward spinwheel {last['spinwheel']:.3f} "
        f"vs TRL {last['trl']:.3f}; "
        f"held-out sampled reward after: spinwheel {runs['spinwheel'].sampled_after:.4f} vs TRL "
        f"{runs['trl'].sampled_after:.4f}"
    )


if __name__ == "__main__":
    main()
