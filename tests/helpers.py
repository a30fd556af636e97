"""What several test modules share, in one place: the tiny models they build, the server tests' waits, the parallel
fidelity oracle (single-process training every layout is compared against) and the RL tests' small config.

Fixtures live in ``conftest.py``; this module holds plain functions and constants, imported as
``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``). No test module imports another.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F

import spinwheel
from spinwheel.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from spinwheel.models import ModelConfig, Transformer
from spinwheel.models.presets import preset_config
from spinwheel.parallel import ParallelConfig, ParallelTrainer
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.llm.agents.agent_proxy import agent_metrics
from spinwheel.rl.llm.episode_tokens import Episode, episode_batch, episode_metrics, episode_rewards
from spinwheel.rl.llm.rollout import Prompt, Rollout, dp_share, gather_dp, sample_seed
from spinwheel.rl.llm.token_advantages import group_advantages
from spinwheel.rl.llm.token_losses import grpo_loss, logprob_mismatch, token_weights
from spinwheel.train.learners import LocalLearner
from spinwheel.train.optim import ADAMW_BETAS, build_adamw, decays, lr_at

# Spawned ranks import this module (they run `run_layouts`): the server's and the RL loop's imports stay inside the
# functions that need them, so a rank does not pay for them.
if TYPE_CHECKING:
    from spinwheel.rl.llm import RLConfig
    from spinwheel.server.engine_client import EngineProcess
    from spinwheel.server.engine_process import EngineSpec

# ---- tiny models --------------------------------------------------------------------------------------------------

TINY_LLAMA_VOCAB, TINY_LLAMA_EOS = 96, 2  # the HF Llama checkpoint of the `tiny_llama` fixture


def tiny_engine_model(max_position_embeddings: int) -> Transformer:
    """The engine tests' model: 2 layers, grouped-query attention (4 heads on 2 KV heads), vocab 100, EOS 2."""
    cfg = ModelConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=2,
    )
    return Transformer(cfg).init_weights(seed=0, std=0.1)


def long_context_model(max_len: int = 2048) -> Transformer:
    """The test preset with a long context, so that a request can run for thousands of steps."""
    return Transformer(preset_config("test", 100, max_position_embeddings=max_len)).init_weights(5)


# ---- commands in this process ------------------------------------------------------------------------------------


def run_cli(argv: list[str], capfd, umask: int | None = None) -> subprocess.CompletedProcess:
    """``spinwheel ARGV`` in this process: ``spinwheel.cli.main`` is what ``python -m spinwheel`` runs, without the
    fresh interpreter (importing torch and spinwheel again costs ~2-3 s of CPU per command). Returns what a
    subprocess would: the exit status (``main``'s, or argparse's ``SystemExit``), stdout and stderr (``capfd``: what
    C++ writes to the file descriptors too), with the warnings the command raised and the log records of level
    WARNING and above on stderr, as a fresh interpreter shows them (its default warning filters; logging's last
    resort handler, the message alone). ``umask`` is set for the command; the thread count it may change is put
    back."""
    from spinwheel.cli import main

    capfd.readouterr()
    threads, mask = torch.get_num_threads(), None if umask is None else os.umask(umask)
    last_resort = logging.StreamHandler(sys.stderr)  # the captured stream, bound now
    last_resort.setLevel(logging.WARNING)
    logging.getLogger().addHandler(last_resort)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()  # a fresh interpreter's filters, not pytest's
            warnings.simplefilter("default")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            try:
                code, message = main(list(argv)), ""
            except SystemExit as e:  # argparse's exits; sys.exit("text") prints the text and exits 1
                code, message = (e.code or 0, "") if isinstance(e.code, int | None) else (1, f"{e.code}\n")
    finally:
        logging.getLogger().removeHandler(last_resort)
        torch.set_num_threads(threads)
        if mask is not None:
            os.umask(mask)
    out, err = capfd.readouterr()
    err += message
    err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)
    return subprocess.CompletedProcess(["spinwheel", *argv], code, out, err)


# ---- the server tests ---------------------------------------------------------------------------------------------

MODEL = "tiny-test"  # the served model name
PROMPTS = ["12+34=", "hello", "a", "The quick brown fox jumps", "7*8="]

# An end-to-end server test that runs against both engine modes: the engine on a thread (the module's own `server`
# fixture) and the engine in its own process (the session's `engine_process_server`, conftest.py).
BOTH_ENGINE_MODES = pytest.mark.parametrize("server", ["thread", "process"], indirect=True)


def server_model() -> Transformer:
    """The server tests' model: the `test` preset, char-level vocab, seed 5."""
    return spinwheel.load_model("test", vocab_size=100, seed=5)


def random_adapter(base: Transformer, path, seed: int, targets: str, rank: int, base_name: str = "test") -> Transformer:
    """Save a random LoRA adapter for ``base`` (B drawn, not zero, so it changes the outputs) to ``path`` as a PEFT
    adapter directory naming ``base_name``; returns ``base`` with it merged in (a copy)."""
    import copy

    from spinwheel.models.lora import LoRAConfig, apply_lora, lora_parameters, merge
    from spinwheel.models.lora_io import save_adapter

    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(rank=rank, alpha=2.0 * rank, targets=targets, base_model_name_or_path=base_name), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    save_adapter(model, path)
    return merge(model)


def engine_spec(model=None, **config) -> EngineSpec:
    """How to start the server tests' engine in its own process (96 blocks of 4 tokens unless ``config`` says)."""
    from spinwheel.server.engine_process import EngineSpec

    config = {"num_kv_blocks": 96, "block_size": 4, **config}
    return EngineSpec(model or server_model(), EngineConfig(**config), spinwheel.Tokenizer.char_level(), num_threads=1)


def wait_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    """Until the engine (on a thread) holds no request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == s.num_waiting == s.num_swapped == 0 and not engine.has_unfinished_requests():
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def wait_engine_idle(ep: EngineProcess, timeout: float = 30.0) -> None:
    """Until the engine process reports no request and no sequence holding blocks."""
    deadline = time.monotonic() + timeout
    while True:
        s = ep.snapshot()
        if not ep.has_unfinished_requests() and s.num_used_blocks == 0 and s.num_block_tables == 0:
            return
        assert time.monotonic() < deadline, f"engine process still busy: {s}"
        time.sleep(0.05)


def all_blocks_free(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return bm.num_used_blocks == 0 and not bm.block_tables and not bm.cpu_block_tables


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus sample (all label sets) from /metrics."""
    import httpx

    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def eventually(check, timeout: float = 10.0) -> None:
    """Wait for ``check()`` to hold (metrics are observed right after the step that made the engine idle)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


# ---- the parallel fidelity oracle ---------------------------------------------------------------------------------
# Every layout trains like one process: per-step losses and final parameters equal (fp32, relative RTOL) to
# single-process training of the same model, data and global batch over STEPS steps: enough for Adam's moments,
# reused buckets and shards, and the scheduled lr's warmup (3 steps) and cosine (3), in half the time of 10 steps.

STEPS = 6
VOCAB, BATCH, SEQ = 64, 8, 12
LR = 1e-3
RTOL = 1e-5
# Adam's update of an element whose gradient is ~0 is ±lr whatever the gradient's size, so the last-bit differences a
# layout's other summation order leaves in near-cancelling gradients became ±lr differences in the weights (2e-5
# relative under TP on an AVX-512 CPU, 9e-6 on others). An eps above those gradients keeps the oracle about layouts.
ADAM_EPS = 1e-6
MAX_NORM = 0.5  # the gradient norm of these batches is ~1.2: every step clips
WEIGHT_DECAY = 0.1


def model_config(tied: bool) -> ModelConfig:
    return preset_config("test", VOCAB, num_hidden_layers=4, tie_word_embeddings=tied)


def make_model(tied: bool) -> Transformer:
    return Transformer(model_config(tied)).init_weights(seed=1)


def optimizer_factory(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=ADAM_EPS)


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.3).float()  # uneven token counts per rank
        out.append((ids, labels, mask))
    return out


def clip_optimizer_factory(params):
    """The SFT recipe's AdamW with its decay left to the trainer (``weight_decay`` + ``decays``)."""
    return torch.optim.AdamW(params, lr=LR, betas=ADAMW_BETAS, weight_decay=0.0)


def scheduled_lr(step: int) -> float:
    return lr_at(step, LR, warmup_steps=3, total_steps=STEPS, min_lr_ratio=0.1)


def reference(tied: bool, clip: bool = False) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Single-process training: the oracle every layout is compared against. With ``clip``: the SFT recipe
    (scheduled lr, weight decay on matrices only, gradient clipping at MAX_NORM). Returns losses, final parameters
    and the gradient norms before clipping."""
    model = make_model(tied)
    opt = build_adamw(model, LR, WEIGHT_DECAY) if clip else optimizer_factory(list(model.parameters()))
    losses, norms = [], []
    for step, (ids, labels, mask) in enumerate(batches()):
        if clip:
            for group in opt.param_groups:
                group["lr"] = scheduled_lr(step)
        logits = model(ids)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (ce * mask.flatten()).sum() / mask.sum()
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("rotary")}
    return losses, params, norms


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def run_layouts(rank: int, world_size: int, layouts: list[tuple[str, dict]], refs: dict) -> dict[str, tuple]:
    """On each spawned rank: train every layout of ``layouts`` in turn; its largest relative errors against
    ``refs[tied, clip]`` (from :func:`reference`) and the parameters it lacks, by layout name."""
    results = {}
    for name, kwargs in layouts:
        kwargs = dict(kwargs)
        tied, clip = kwargs.pop("tied", False), kwargs.pop("clip", False)
        if clip:
            trainer = ParallelTrainer(
                make_model(tied),
                clip_optimizer_factory,
                ParallelConfig(**kwargs),
                max_grad_norm=MAX_NORM,
                weight_decay=WEIGHT_DECAY,
                decays=decays,
            )
        else:
            trainer = ParallelTrainer(make_model(tied), optimizer_factory, ParallelConfig(**kwargs))
        losses, norms = [], []
        for step, b in enumerate(batches()):
            if clip:
                trainer.set_lr(scheduled_lr(step))
            losses.append(trainer.step(*b))
            norms.append(trainer.grad_norm)
        full = trainer.full_state_dict()
        ref_losses, ref_params, ref_norms = refs[tied, clip]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        missing = sorted(set(ref_params) - set(full))
        param_err = max(rel_err(full[k], v) for k, v in ref_params.items() if k in full)
        if clip:
            loss_err = max([loss_err] + [abs(a - b) / b for a, b in zip(norms, ref_norms)])
        results[name] = (loss_err, param_err, missing)
    return results


def check_layouts(results: list[dict], layouts) -> None:
    """Every rank of every layout within RTOL of the reference, with every parameter present."""
    failures = []
    for name, _ in layouts:
        for rank, res in enumerate(results):
            loss_err, param_err, missing = res[name]
            if loss_err > RTOL or param_err > RTOL or missing:
                failures.append(
                    f"{name} rank {rank}: loss rel err {loss_err:.2e}, param rel err {param_err:.2e}, missing {missing}"
                )
    assert not failures, "\n".join(failures)


# ---- the LLM RL tests ---------------------------------------------------------------------------------------------

# A random model never answers arithmetic right; this reward (share of digits in the completion) varies within
# groups from the first step, so every step has a gradient. The `digit_reward` fixture puts it on the path.
REWARD_MODULE = (
    "def digits(completions, answers):\n    return [sum(ch.isdigit() for ch in c) / 5 for c in completions]\n"
)


def small_config(out_dir, **kw) -> RLConfig:
    """A 5-step RL run of the `test` model on 1-digit arithmetic with the digit reward."""
    from spinwheel.rl.llm import RLConfig
    from spinwheel.tasks.arithmetic import ArithmeticConfig

    base = dict(
        model="test",
        out_dir=str(out_dir),
        steps=5,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=5,
        reward="rl_test_reward:digits",
        lr=3e-3,
        beta=0.05,
        eval_every=0,
        eval_examples=8,
        save_every=0,
        progress=False,
        num_threads=1,
        task=ArithmeticConfig(num_digits=1, num_train=40, num_test=8),
    )
    base.update(kw)
    return RLConfig(**base)


# The pre-episodes sampler of one-step RL rollouts (spinwheel.rl.llm.rollout before episodes replaced it): the
# reference the one-step episodes (and the preference samplers that play them) are tested against.
def generate_share(
    llm: LLM, prompts: list[Prompt], params: list[SamplingParams]
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Sample each prompt with its ``params`` on ``llm``: the completions' token ids, engine log-probs and texts,
    prompt-major."""
    outs = llm.generate([list(p.ids) for p in prompts], params)
    ids, logps, texts = [], [], []
    for p, out in zip(prompts, outs):
        if out.error:
            raise ValueError(f"rollout of prompt {p.text!r} failed: {out.error}")
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids.append(list(c.token_ids))
            logps.append([lp[t] for t, lp in zip(c.token_ids, c.logprobs or [])])
            texts.append(c.text)
    return ids, logps, texts


def generate_rollout(
    llm: LLM,
    prompts: list[Prompt],
    step: int,
    seed: int,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    dims: ParallelDims | None = None,
) -> Rollout:
    """The step's global rollout; under torchrun each data-parallel rank samples its contiguous share of the
    prompts (the last shares may be shorter), then every rank receives every share (collective over the world)."""
    first, count = dp_share(len(prompts), dims)
    own = prompts[first : first + count]
    params = [
        SamplingParams(
            n=group_size,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_new_tokens,
            seed=sample_seed(seed, step, first + k),  # the prompt's global index: the same samples on any layout
            logprobs=0,
            logprobs_mode="processed",  # of the tempered distribution the tokens were drawn from
        )
        for k in range(len(own))
    ]
    parts = gather_dp(generate_share(llm, own, params), dims)
    ids = [row for part in parts for row in part[0]]
    logps = [row for part in parts for row in part[1]]
    texts = [row for part in parts for row in part[2]]
    return Rollout(prompts, group_size, ids, logps, texts)


# ---- a plain GRPO update on recorded episodes (the agent tests' reference) ----------------------------------------


def grpo_step(
    learner: LocalLearner,
    episodes: list[Episode],
    group_size: int,
    lr: float,
    updates: int,
    pad: int,
    loss_agg: str = "token-mean",
) -> dict:
    """One GRPO update on agent episodes (group-major, ``group_size`` per task), written out plainly as the tests'
    reference (the run loop does the same through its algorithm); the step's figures."""
    rewards, keep = episode_rewards(episodes, group_size)
    batch = episode_batch(episodes, pad)
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    old = learner.forward(inputs)["logprobs"]
    advantages = group_advantages(rewards, group_size)
    weights = token_weights(batch["mask"] * keep[:, None], loss_agg)  # type: ignore[arg-type]

    def loss_fn(out: Any, _batch: Any) -> tuple[torch.Tensor, dict]:
        return grpo_loss(out.logprobs, old, advantages, weights)

    losses = [learner.train_step(inputs, loss_fn, lr).loss for _ in range(updates)]
    mismatch = logprob_mismatch(old, batch["engine_logprobs"], batch["mask"])
    return {
        "loss": losses[-1],
        "mismatch_max": float(mismatch["mismatch_max"]),
        **episode_metrics(episodes),
        **agent_metrics(episodes),  # type: ignore[arg-type]
    }
