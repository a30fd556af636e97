"""GRPO with a tool, multi-turn: TRL 1.16's ``GRPOTrainer`` (its multi-turn path, ``rollout_func`` with ``env_mask``)
vs ``spinwheel grpo --env calculator``, side by side in one process, from the same SFT checkpoint.

    python benchmarks/agent_vs_trl.py --model runs/demo/agent/sft/checkpoint [--steps 40] [--threads 2]

``--model``: the SFT checkpoint of ``spinwheel demo --agent`` (``<out-dir>/agent/sft/checkpoint``: the ``tiny``
preset after SFT on calculator expert traces, HF format).

**Which TRL path.** TRL 1.16 has three ways to play multi-turn episodes in ``GRPOTrainer``: ``tools=[fn, ...]`` and
``environment_factory`` (the model calls Python functions through its chat template's tool-calling format: the
tokenizer must render tool schemas and parse tool calls back, transformers ≥ 5.2), and ``rollout_func`` (the user's
function plays the episodes and returns ``prompt_ids``, ``completion_ids``, ``logprobs`` and, as an extra field,
``env_mask``: 0 on the environment's tokens, which the loss then skips). The char model has no chat template and the
calculator's format is raw text (``317*46=<calc>317*46</calc>=14582\\n14582``), so the tool-calling paths do not
apply; ``rollout_func`` does, and it is what this script uses. TRL provides no engine to it without vLLM (none on
CPU): the function here generates with ``model.generate`` turn by turn, a turn ending at EOS, at ``</calc>`` (a
stopping criterion on the token suffix) or at ``--max-new-tokens``; the tool's answer is appended as tokens and the
next turn re-submits the whole sequence (``generate`` keeps no KV between calls). The tokens it returns are those
sampled and fed (no re-tokenisation), the environment is spinwheel's ``CalculatorEnv`` (same problems, same rules,
same reward), so the two runs differ in their generation engines and trainers only.

Matched settings as ``benchmarks/grpo_vs_trl.py`` (TRL ``loss_type="dapo"`` ↔ ``--loss-agg token-mean``,
``scale_rewards="group"``, one optimizer step per rollout, constant lr, AdamW β₂ 0.95, clip 1.0, fp32, temperature
1, ``beta`` ↔ ``--beta`` with k3); problems: step s draws the environment seeds ``sample_seed(seed, s, k)`` in both.
Timing: the two trainers run in two threads that take turns one step at a time (grpo_vs_trl's ``Baton``), the first
step left out, medians reported with their process CPU time. Learning: the mean sampled reward of the first and last
``--last`` steps, and held-out success of each final policy (and the SFT checkpoint) by one evaluator: greedy
episodes of the test split on spinwheel's engine (``spinwheel.agent_demo.held_out``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_vs_trl import SYSTEMS, Baton, Run, _SteppedBar, matched_config, print_phases  # noqa: E402

import spinwheel.train.run as run_harness  # noqa: E402
from spinwheel.agent_demo import held_out, success  # noqa: E402
from spinwheel.envs import load_env  # noqa: E402
from spinwheel.envs.base import Action  # noqa: E402
from spinwheel.models.tokenizer import load_tokenizer  # noqa: E402
from spinwheel.rl.llm import RLConfig, train_rl  # noqa: E402
from spinwheel.rl.llm.rollout import sample_seed  # noqa: E402

STOP = "</calc>"


def run_spinwheel(args, ckpt: Path, work: Path, run: Run) -> None:
    config = RLConfig(
        algo="grpo",
        model=str(ckpt),
        env="calculator",
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
        eval_examples=1,  # held-out success is measured afterwards, by one evaluator for both
        save_every=0,
        seed=args.seed,
        resume=False,
        num_threads=args.threads,
        progress=False,
    )
    run_harness.tqdm = lambda steps, **k: _SteppedBar(run, steps, **k)  # the harness draws the step loop
    result = train_rl(config)
    for record in result["history"]:
        run.rewards.append(record["reward_mean"])
        for key, value in record.items():
            if key.startswith("time/"):
                run.phases[key[5:]].append(value)


class EpisodePlayer:
    """TRL's ``rollout_func``: G episodes per prompt row on ``model.generate``, turn by turn (module docstring)."""

    def __init__(self, ckpt: Path, hf_tokenizer, max_new_tokens: int, seeds: dict[str, int], acc: dict) -> None:
        from transformers import StoppingCriteria

        self.tok, self.max_new_tokens, self.seeds, self.acc = load_tokenizer(ckpt), max_new_tokens, seeds, acc
        self.make_env = load_env("calculator")
        self.stop_ids = self.tok.encode(STOP, add_special_tokens=False)
        self.eos, self.pad = hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id
        stop_ids = self.stop_ids

        class StopAtTag(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                tail = torch.tensor(stop_ids, device=input_ids.device)
                return (input_ids[:, -len(stop_ids) :] == tail).all(dim=1)

        self.criteria = [StopAtTag()]

    def generate(self, model, seqs: list[list[int]]) -> list[list[int]]:
        """One turn of each sequence: the sampled tokens, cut after EOS or the closing tag."""
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[self.pad] * (width - len(s)) + s for s in seqs])
        attention = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=attention, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=self.max_new_tokens, stopping_criteria=self.criteria, pad_token_id=self.pad,
                eos_token_id=self.eos,
            )  # fmt: skip
        turns = []
        for row in out[:, width:].tolist():
            cut = len(row)
            for j, token in enumerate(row):
                if token == self.eos or row[max(0, j + 1 - len(self.stop_ids)) : j + 1] == self.stop_ids:
                    cut = j + 1
                    break
            turns.append(row[:cut])
        return turns

    def __call__(self, prompts: list[str], trainer) -> dict:
        t0 = time.perf_counter()
        G = trainer.num_generations
        if len(prompts) % G or any(len(set(prompts[i : i + G])) != 1 for i in range(0, len(prompts), G)):
            raise RuntimeError("rollout_func expected each prompt G times in a row (TRL's RepeatSampler)")
        model = trainer.accelerator.unwrap_model(trainer.model)
        envs = [self.make_env("train") for _ in prompts]
        prompt_ids = [self.tok.encode(env.reset(self.seeds[p])) for env, p in zip(envs, prompts)]
        seqs = [list(p) for p in prompt_ids]
        completion = [[] for _ in prompts]
        mask = [[] for _ in prompts]
        rewards, live = [0.0] * len(prompts), list(range(len(prompts)))
        while live:
            turns, still = self.generate(model, [seqs[i] for i in live]), []
            for i, ids in zip(live, turns):
                step = envs[i].step(Action(self.tok.decode(ids, skip_special_tokens=True), ids))
                completion[i] += ids
                mask[i] += [1] * len(ids)
                rewards[i] += step.reward
                if step.done:
                    continue
                obs = self.tok.encode(step.observation, add_special_tokens=False)
                completion[i] += obs
                mask[i] += [0] * len(obs)
                seqs[i] = seqs[i] + ids + obs
                still.append(i)
            live = still
        self.acc["generate"] += time.perf_counter() - t0
        out = {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": None, "env_mask": mask}
        return {**out, "env_reward": rewards}


def run_trl(args, ckpt: Path, work: Path, run: Run):
    """TRL's run with ``rollout_func``; returns the trainer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(ckpt, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
    env = load_env("calculator")("train")
    seeds = [sample_seed(args.seed, step, k) for step in range(args.steps) for k in range(args.prompts)]
    texts = [env.reset(s) for s in seeds]
    dataset = Dataset.from_dict({"prompt": texts})
    acc: dict[str, float] = {"generate": 0.0, "training_step": 0.0}
    player = EpisodePlayer(ckpt, tokenizer, args.max_new_tokens, dict(zip(texts, seeds)), acc)

    def env_reward(prompts, completions, env_reward, **_):
        run.rewards.append(sum(env_reward) / len(env_reward))
        return env_reward

    config = matched_config(args, work, 4 * args.max_new_tokens)
    trainer = GRPOTrainer(
        model=model, reward_funcs=env_reward, args=config, train_dataset=dataset, processing_class=tokenizer,
        rollout_func=player,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    inner = trainer.training_step

    def training_step(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            acc["training_step"] += time.perf_counter() - t0

    trainer.training_step = training_step

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            run.start()

        def on_step_end(self, *a, **k):
            wall = time.perf_counter() - run.started[0]
            run.phases["generate"].append(acc["generate"])
            run.phases["train (rest of training_step)"].append(acc["training_step"] - acc["generate"])
            run.phases["rest"].append(wall - acc["training_step"])
            acc.update(generate=0.0, training_step=0.0)
            run.boundary()

    trainer.add_callback(StepClock())
    torch.manual_seed(args.seed)
    try:
        trainer.train()
    finally:
        run.baton.hand_on(run.name, leave=True)
    return trainer


def run_both(args, ckpt: Path, work: Path) -> dict[str, Run]:
    baton = Baton()
    runs = {name: Run(name, baton) for name in SYSTEMS}
    out: dict[str, object] = {}

    def target(name: str, fn) -> None:
        torch.set_num_threads(args.threads)
        baton.take(name)
        try:
            out[name] = fn(args, ckpt, work, runs[name])
        except BaseException as e:  # noqa: BLE001 — re-raised in the main thread
            out[name] = e
        finally:
            baton.hand_on(name, leave=True)

    systems = (("trl", run_trl), ("spinwheel", run_spinwheel))
    threads = [threading.Thread(target=target, args=(n, f), name=n) for n, f in systems]
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
        runs[name].eval_after, runs[name].sampled_after = success(held_out(path, args.eval_examples)[0])
    for run in runs.values():  # the first step is warm-up
        run.step_times, run.cpu_times = run.step_times[1:], run.cpu_times[1:]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/demo/agent/sft/checkpoint", help="the SFT checkpoint (HF format)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=16, help="problems per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=20, help="tokens per turn at most")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--last", type=int, default=10, help="steps the first/last mean sampled reward is taken over")
    parser.add_argument("--eval-examples", type=int, default=200, help="held-out problems, greedy")
    parser.add_argument("--work-dir", default=None, help="where runs write (default: a temporary directory)")
    args = parser.parse_args()
    ckpt = Path(args.model)
    if not (ckpt / "config.json").is_file():
        raise SystemExit(f"--model {ckpt}: no checkpoint there; run `spinwheel demo --agent` first (its agent/sft)")
    torch.set_num_threads(args.threads)
    print(
        f"workload: {args.steps} steps × {args.prompts} problems × G {args.group_size}, ≤ {args.max_new_tokens} "
        f"tokens per turn, lr {args.lr}, β {args.beta}, ε {args.epsilon}, seed {args.seed}, threads {args.threads}"
    )
    before = success(held_out(ckpt, args.eval_examples)[0])
    with tempfile.TemporaryDirectory(prefix="agent_vs_trl-") as tmp:
        t0 = time.perf_counter()
        runs = run_both(args, ckpt, Path(args.work_dir or tmp))
        print(f"  both runs in turns: {time.perf_counter() - t0:.1f} s", flush=True)
    med = {name: (statistics.median(r.step_times), statistics.median(r.cpu_times)) for name, r in runs.items()}
    n = args.last
    print(f"  SFT checkpoint: held-out success {before[0]:.1%} (correct episodes calling the tool {before[1]})")
    for name, run in runs.items():
        print(
            f"  {name:>9}: {1e3 * med[name][0]:.0f} ms/step median (CPU {1e3 * med[name][1]:.0f} ms/step); sampled "
            f"reward first {n} steps {statistics.fmean(run.rewards[:n]):.3f} → last {n} "
            f"{statistics.fmean(run.rewards[-n:]):.3f}; held-out success after {run.eval_after:.1%} (correct "
            f"episodes calling the tool {run.sampled_after})"
        )
    for run in runs.values():
        print_phases(run)
    print(
        f"spinwheel / TRL step time: {med['spinwheel'][0] / med['trl'][0]:.3f} (CPU time "
        f"{med['spinwheel'][1] / med['trl'][1]:.3f}); held-out success after: spinwheel "
        f"{runs['spinwheel'].eval_after:.1%} vs TRL {runs['trl'].eval_after:.1%} (SFT {before[0]:.1%})"
    )


if __name__ == "__main__":
    main()
