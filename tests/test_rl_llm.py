"""The LLM RL loop (GRPO family) on spinwheel's engine and trainer: rollout layout and seeds, reward checks, the
loop's per-step figures, parity of every parallel layout with one process, exact resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import run_cli, small_config

from spinwheel.engine.config import EngineConfig
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.parallel import spawn
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.rewards import RewardError, load_reward_fn, score
from spinwheel.rl.llm.rollout import Prompt, Rollout, rollout_batch, sample_seed
from spinwheel.train.metrics import read_metrics

RTOL = 1e-5
pytestmark = pytest.mark.usefixtures("digit_reward")  # the reward module `rl_test_reward:digits` (helpers.py)


def test_rollout_batch_layout():
    tok = Tokenizer.char_level()
    p = [Prompt("1+2=", tuple(tok.encode("1+2=")), "3"), Prompt("12+3=", tuple(tok.encode("12+3=")), "15")]
    eos = tok.eos_id
    comps = [[tok.encode("3", add_special_tokens=False)[0], eos], [7], [8, 9, eos], [5]]
    r = Rollout(p, 2, comps, [[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6], [-0.7]], ["", "", "", ""])
    b = rollout_batch(r, pad_id=0)
    assert b["input_ids"].shape == b["labels"].shape == b["mask"].shape == (4, 8)  # 6 prompt + 3 completion − 1
    assert b["mask"].sum(1).tolist() == [2, 1, 3, 1]
    row = 2  # prompt 1 (6 ids with BOS), completion [8, 9, eos]: labels 5..7
    assert b["labels"][row, 5:8].tolist() == [8, 9, eos] and b["mask"][row, 5:8].tolist() == [1, 1, 1]
    assert b["input_ids"][row, :6].tolist() == list(p[1].ids)
    assert torch.allclose(b["engine_logprobs"][row, 5:8], torch.tensor([-0.4, -0.5, -0.6]))
    assert b["engine_logprobs"][0, 4:6].tolist() == pytest.approx([-0.1, -0.2])
    assert len({sample_seed(0, s, i) for s in range(50) for i in range(50)}) == 2500


def test_shared_prompt_forward_equals_one_row_per_completion():
    """The local learner runs each group's prompt once (packed rows, block mask): the same log-probs, entropies and
    gradients as the plain padded forward of every row, and zeros off the completions; it packs short completions
    (fewer FLOPs) and not long ones (attention over the packed row would cost more)."""
    from spinwheel.models.hf import load_model
    from spinwheel.train.learners import local_outputs
    from spinwheel.train.shared_prompts import SharedPrompts, plain_cost, shared_prompt_outputs

    tok = Tokenizer.char_level()
    model = load_model("test", seed=3, vocab_size=tok.vocab_size)
    prompts = [Prompt(t, tuple(tok.encode(t)), "") for t in ("12+34=", "5+6=", "12+34=")]  # a prompt seen twice
    gen = torch.Generator().manual_seed(0)
    comps = [torch.randint(4, 40, (int(n),), generator=gen).tolist() for n in torch.randint(1, 7, (9,), generator=gen)]
    batch = rollout_batch(Rollout(prompts, 3, comps, [[0.0] * len(c) for c in comps], [""] * 9), pad_id=0)
    plain = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    shared = {**plain, "prompt_lens": batch["prompt_lens"], "completion_lens": batch["completion_lens"]}
    packed = SharedPrompts.of(shared)
    assert packed is not None and len(packed.tokens) == 2  # two distinct prompts
    mask = batch["mask"]
    ref, out = local_outputs(model, plain, entropy=True), shared_prompt_outputs(model, shared, packed, entropy=True)
    torch.testing.assert_close(out.logprobs * mask, ref.logprobs * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.entropy * mask, ref.entropy * mask, rtol=1e-5, atol=1e-6)
    assert out.logprobs[mask == 0].abs().max() == 0 and out.entropy[mask == 0].abs().max() == 0
    w = torch.randn(mask.shape, generator=gen) * mask
    params = list(model.parameters())
    for g_ref, g in zip(
        torch.autograd.grad((ref.logprobs * w).sum(), params), torch.autograd.grad((out.logprobs * w).sum(), params)
    ):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)

    def ratio(num_tokens: int) -> float:  # 4 prompts × G 8 completions of num_tokens each
        rows = [Prompt(f"{i}+1=", tuple(tok.encode(f"{i}+1=")), "") for i in range(10, 14)]
        b = rollout_batch(Rollout(rows, 8, [[5] * num_tokens] * 32, [[0.0] * num_tokens] * 32, [""] * 32), 0)
        return SharedPrompts.of(b).cost(model.config) / plain_cost(model.config, *b["input_ids"].shape)

    assert ratio(3) < 0.5 and ratio(64) > 1


def test_reward_functions_are_checked(tmp_path, monkeypatch):
    task = load_reward_fn("task")
    assert score(task, ["12", "1"], ["12", "2"]).tolist() == [1.0, 0.0]
    (tmp_path / "myrewards.py").write_text(
        "def nan(c, a):\n    return [float('nan')] * len(c)\n"
        "def short(c, a):\n    return [1.0]\n"
        "def boom(c, a):\n    raise RuntimeError('bad')\n"
        "def length(c, a):\n    return [len(x) for x in c]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert score(load_reward_fn("myrewards:length"), ["ab", "c"], ["", ""]).tolist() == [2.0, 1.0]
    for name, message in [("nan", "non-finite"), ("short", "returned 1 values for 2"), ("boom", "raised RuntimeError")]:
        with pytest.raises(RewardError, match=message):
            score(load_reward_fn(f"myrewards:{name}"), ["a", "b"], ["", ""])
    for bad in ["nope", "myrewards:missing", "no_such_module:f"]:
        with pytest.raises(RewardError):
            load_reward_fn(bad)


def test_messages_lines_render_with_the_chat_template(tmp_path):
    from spinwheel.models.tokenizer import load_tokenizer
    from spinwheel.rl.llm.build import load_prompts
    from spinwheel.tasks.data import DataError

    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}]
    data = tmp_path / "rl.jsonl"
    data.write_text(json.dumps({"messages": chat, "answer": 4}) + "\n" + json.dumps({"prompt": "1+1=", "answer": 2}))
    tok = load_tokenizer("test")
    train, held_out = load_prompts(small_config(tmp_path, data=str(data)), tok)
    by_answer = {p.answer: p for p in train + held_out}
    rendered = "<bos><|system|>\nAdd.\n<|user|>\n2+2=\n<|assistant|>\n"
    assert by_answer["4"].text == rendered
    assert list(by_answer["4"].ids) == tok.encode(rendered, add_special_tokens=False)
    assert by_answer["4"].ids.count(tok.bos_id) == 1  # the template's BOS only, not a second one
    assert list(by_answer["2"].ids) == tok.encode("1+1=")  # plain prompts keep the tokenizer's BOS
    tok.chat_template = None
    with pytest.raises(DataError, match="'messages' lines need the checkpoint's chat template"):
        load_prompts(small_config(tmp_path, data=str(data)), tok)


def test_resume_refuses_what_changes_the_run_and_a_finished_run_does_nothing(tmp_path, capsys):
    train_rl(small_config(tmp_path, steps=3, stop_after=2))
    with pytest.raises(ValueError, match=r"other settings \(--lr 0.003 -> 0.001\).*--force"):
        train_rl(small_config(tmp_path, steps=3, lr=1e-3))
    capsys.readouterr()
    result = train_rl(small_config(tmp_path, steps=3, eval_every=1))  # a cadence change is taken
    assert result["start_step"] == 2 and result["end_step"] == 3
    assert "resuming from step 2 of 3" in capsys.readouterr().out
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    again = train_rl(small_config(tmp_path, steps=3))
    assert again["finished"] and "the run is finished, nothing to do" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines  # nothing appended


@pytest.mark.parametrize("packed", [False, True])
def test_grpo_loop_one_process(tmp_path, packed):
    """The loop's engine samples from plain weights by default; with oneDNN-packed copies it repacks after every
    update (else steps 2 and 3 would sample from stale weights and the mismatch would show it)."""
    engine = EngineConfig(cpu_packed_weights=packed)
    result = train_rl(small_config(tmp_path, steps=3, eval_every=2, engine=engine))
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["mismatch_max"] < 1e-4  # fp32: the engine and the trainer agree on the sampled tokens
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # one on-policy update: old == current
        assert r["kl_ref"] > 0 or r["step"] == 1
        assert all(f"time/{p}" in r for p in ("generate", "score", "logprobs", "update", "sync"))
    assert any("eval_reward" in r for r in read_metrics(tmp_path / "metrics.jsonl"))  # the run's own (digit) reward
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "checkpoint" / "config.json").is_file()
    assert result["eval_after"] is not None


def test_on_policy_shortcut_equals_the_old_policy_forward(tmp_path, monkeypatch):
    """One update per rollout reuses the update's own log-probs as the old policy's: the same steps as running the
    separate old-policy forward (losses, KL, mismatch, TIS weights and the final weights)."""
    import spinwheel.rl.llm.loop as loop

    def run(name: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
        train_rl(small_config(tmp_path / name, steps=3, tis_cap=2.0))
        from spinwheel.models.hf import load_model

        recs = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "reward_mean" in r]
        return recs, load_model(tmp_path / name / "checkpoint").state_dict()

    fast, fast_w = run("fast")
    monkeypatch.setattr(loop, "reuses_update_logprobs", lambda *a: False)
    exact, exact_w = run("exact")
    assert [r["reward_mean"] for r in fast] == [r["reward_mean"] for r in exact]
    for key in ("loss", "kl_ref", "kl", "mismatch_max", "mismatch_mean", "is_weight_mean", "ratio_mean"):
        assert [r[key] for r in fast] == pytest.approx([r[key] for r in exact], rel=RTOL, abs=1e-6), key
    assert all(r["approx_kl"] == 0.0 and r["clip_frac"] == 0.0 for r in fast)  # exactly on-policy: log ratio 0
    for name, w in fast_w.items():
        torch.testing.assert_close(w, exact_w[name], rtol=RTOL, atol=1e-6)


LAYOUTS = [("dp2", dict(dp=2)), ("zero3", dict(zero=3)), ("tp2", dict(tp=2)), ("pp2", dict(pp=2, microbatches=2))]


def _losses(path) -> tuple[list[float], list[float]]:
    recs = [r for r in read_metrics(path) if "reward_mean" in r]
    return [r["loss"] for r in recs], [r["reward_mean"] for r in recs]


def _layout_worker(rank: int, world_size: int, root: str) -> None:
    from spinwheel.parallel import ParallelConfig

    for name, kwargs in LAYOUTS:
        train_rl(small_config(f"{root}/{name}", parallel=ParallelConfig(**kwargs)))


@pytest.mark.slow
@pytest.mark.distributed
def test_layouts_match_one_process(tmp_path):
    """GRPO under dp 2, ZeRO-3, tp 2 and pp 2 draws the same rollouts and takes the same steps as one process."""
    train_rl(small_config(tmp_path / "one"))
    ref_loss, ref_reward = _losses(tmp_path / "one" / "metrics.jsonl")
    assert len(ref_loss) == 5 and len(set(ref_reward)) > 1
    spawn(_layout_worker, 2, args=(str(tmp_path),), timeout_s=400)
    for name, _ in LAYOUTS:
        loss, reward = _losses(tmp_path / name / "metrics.jsonl")
        assert reward == ref_reward, name  # identical rollouts and rewards
        assert loss == pytest.approx(ref_loss, rel=RTOL, abs=1e-7), name


@pytest.mark.slow
def test_sigkill_then_rerun_resumes_exactly(tmp_path, capfd):
    """Also with the asynchronous machinery at K = 0, its engine in a child process (which the kill orphans: it
    exits when its pipe closes). The runs that are killed are subprocesses; the uninterrupted run and the reruns
    are the same command in this process."""
    args = [
        "--model",
        "test",
        "--steps",
        "8",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "5",
        "--lr",
        "3e-3",
        "--beta",
        "0.05",
        "--reward",
        "rl_test_reward:digits",
        "--eval-every",
        "0",
        "--eval-examples",
        "4",
        "--save-every",
        "2",
        "--no-progress",
        "--num-threads",
        "1",
        "--task-num-digits",
        "1",
        "--task-num-train",
        "40",
        "--task-num-test",
        "8",
    ]

    def command(out, *extra):
        return [sys.executable, "-m", "spinwheel.cli", "grpo", *args, *extra, "--out-dir", str(out)]

    def run_here(out, *extra):  # ``command`` in this process
        proc = run_cli(command(out, *extra)[3:], capfd)
        assert proc.returncode == 0, proc.stderr

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_here(tmp_path / "full")
    for name, extra in (("killed", ()), ("async", ("--max-staleness", "0", "--rollout-engine", "process"))):
        proc = subprocess.Popen(
            command(tmp_path / name, *extra), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        metrics = tmp_path / name / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # kill once step 5 is logged: the last checkpoint is step 4
            if metrics.exists() and any(
                json.loads(x).get("step", 0) >= 5 and "loss" in x for x in metrics.read_text().splitlines() if x.strip()
            ):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        run_here(tmp_path / name, *extra)
        full, killed = _losses(tmp_path / "full" / "metrics.jsonl"), _losses(tmp_path / name / "metrics.jsonl")
        assert len(killed[0]) == 8
        assert killed == full, name


def test_reward_model_as_the_reward(tmp_path):
    """--reward-model: a scalar-head checkpoint scores (prompt, completion); an LM checkpoint is refused."""
    from spinwheel.models import load_model, save_pretrained
    from spinwheel.models.transformer import scalar_head_model

    rm_dir = tmp_path / "rm"
    save_pretrained(scalar_head_model(load_model("test", seed=1), seed=2, std=1.0), rm_dir)
    Tokenizer.char_level().save_pretrained(rm_dir)
    train_rl(small_config(tmp_path / "run", steps=1, beta=0.0, reward_model=str(rm_dir)))
    rec = next(r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in r)
    assert rec["reward_std"] > 0 and rec["reward_mean"] not in (0.0, 1.0)  # continuous scores, not a task reward
    lm_dir = tmp_path / "lm"
    save_pretrained(load_model("test", seed=1), lm_dir)
    Tokenizer.char_level().save_pretrained(lm_dir)
    with pytest.raises(ValueError, match="not a reward model"):
        train_rl(small_config(tmp_path / "run2", steps=1, reward_model=str(lm_dir)))


def test_held_out_evaluation_scores_with_the_runs_own_reward(tmp_path, monkeypatch):
    """A JSONL with text answers and a user's reward: evaluation scores greedy completions with that reward (it
    used to stop at step 0 comparing the answers as the arithmetic task's integers)."""
    rows = [{"prompt": f"sort:{w}=", "answer": "".join(sorted(w))} for w in ("cba", "bca", "acb", "bac", "cab", "abc")]
    (tmp_path / "sort.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sort_reward.py").write_text(
        "def first_letter(completions, answers):\n"
        "    return [0.5 + float(c[:1] == a[:1]) for c, a in zip(completions, answers)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(
        tmp_path / "run", steps=1, data=str(tmp_path / "sort.jsonl"), reward="sort_reward:first_letter"
    )
    result = train_rl(config)
    evals = [r["eval_reward"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval_reward" in r]
    assert len(evals) == 2 and all(0.5 <= v <= 1.5 for v in evals)  # the user's scale, not exact match's 0/1
    assert result["eval_after"] == evals[-1] and result["eval_label"] == "mean reward"


def test_held_out_evaluation_is_greedy_episodes_scored_by_the_reward(tmp_path):
    """The step-0 evaluation equals greedy generation on the held-out prompts scored by the run's reward, computed
    here without the episode machinery."""
    from spinwheel.engine import LLM, SamplingParams
    from spinwheel.models.hf import load_model
    from spinwheel.models.tokenizer import load_tokenizer
    from spinwheel.rl.llm.build import load_prompts

    config = small_config(tmp_path, steps=1, eval_examples=8)
    result = train_rl(config)
    tok = load_tokenizer("test")
    model = load_model("test", vocab_size=tok.vocab_size, seed=config.seed)
    prompts = load_prompts(config, tok)[1][:8]
    outs = LLM(model, tok, seed=0).generate([list(p.ids) for p in prompts], SamplingParams(temperature=0, max_tokens=5))
    rewards = load_reward_fn(config.reward)([o.outputs[0].text for o in outs], [p.answer for p in prompts])
    assert result["eval_before"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
