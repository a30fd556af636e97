"""Supervised fine-tuning: next-token cross-entropy on completion tokens only.

The loop reads top to bottom: build model, tokenizer and data; for each step, take the step's batch (a pure
function of the seed and the step number, so resuming needs no sampler state), run :func:`completion_loss`, clip,
step AdamW at the scheduled learning rate; log, evaluate held-out exact match with greedy decoding, and save
atomic checkpoints that resume exactly.

The loop (:func:`run_sft`) is the same in one process and under ``torchrun``; what steps the model is a *learner*:
:class:`LocalLearner` here (the reference), or :class:`~spinwheel.train.parallel_sft.ParallelLearner` on the
parallel trainer when torchrun started more than one process (see :mod:`spinwheel.train.parallel_sft`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from spinwheel.config import option
from spinwheel.models.generate import generate
from spinwheel.models.hf import load_model, resolve_dtype
from spinwheel.models.tokenizer import Tokenizer, load_tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.launch import launched_world_size
from spinwheel.parallel.train import ParallelConfig
from spinwheel.tasks.arithmetic import ArithmeticConfig, ArithmeticTask, reward
from spinwheel.tasks.data import read_sft_jsonl
from spinwheel.train.checkpoint import load_trainer_state, rng_state, save_checkpoint, set_rng_state
from spinwheel.train.metrics import MetricsLogger, plot_curves
from spinwheel.train.optim import build_adamw, lr_at, set_lr


@dataclass
class SFTConfig:
    """Supervised fine-tuning on completion tokens (built-in arithmetic task or your JSONL)."""

    model: str = option("tiny", help="built-in preset (tiny, small, test) or a HF checkpoint directory")
    data: str | None = option(None, help="SFT JSONL with {prompt, completion} or {messages} lines; "
                                         "default: the built-in arithmetic task")
    eval_fraction: float = option(0.05, help="share of --data lines held out for evaluation")
    out_dir: str = option("runs/sft", help="where checkpoint/, metrics.jsonl and curves.png are written")
    steps: int = option(1500, help="optimizer steps")
    batch_size: int = option(128, help="sequences per step")
    lr: float = option(3e-3, help="peak learning rate (AdamW)")
    min_lr_ratio: float = option(0.1, help="final learning rate as a fraction of --lr (cosine decay)")
    warmup_steps: int = option(100, help="linear warmup steps")
    weight_decay: float = option(0.1, help="AdamW decoupled weight decay on weight matrices")
    grad_clip: float = option(1.0, help="max global gradient norm (0 disables clipping)")
    eval_every: int = option(500, help="evaluate held-out exact match every N steps (0: only at the end)")
    eval_examples: int = option(500, help="held-out examples per evaluation")
    max_new_tokens: int = option(16, help="max tokens generated per held-out prompt at evaluation")
    eval_engine: bool = option(True, help="evaluate with the paged-attention serving engine (--no-eval-engine: "
                                          "the plain reference generate loop)")
    save_every: int = option(500, help="write a checkpoint every N steps (0: only at the end)")
    max_seq_len: int = option(256, help="longer examples are dropped (their count is reported)")
    seed: int = option(0, help="seed of the model init and the data order")
    resume: bool = option(True, help="resume from <out_dir>/checkpoint when it exists")
    dtype: str = option("float32", help="parameter dtype: float32, bfloat16 or float16 (GPUs)")
    device: str = option("cpu", help="torch device, e.g. cpu or cuda")
    num_threads: int = option(0, help="torch CPU threads (0: PyTorch's default)")
    stop_after: int | None = option(None, help="stop (with a checkpoint) after this many steps of this run; "
                                               "resume later with the same command")
    progress: bool = option(True, help="show a progress bar")
    task: ArithmeticConfig = field(default_factory=ArithmeticConfig, metadata={"cli": False})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"cli": False})

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_examples", "max_new_tokens", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"--stop-after must be >= 1, got {self.stop_after}")
        resolve_dtype(self.dtype)


@dataclass(frozen=True)
class SFTExample:
    """A tokenized example: ``prompt_ids`` (with BOS) then ``completion_ids`` (with EOS); ``reference`` is what a
    generated completion is scored against."""

    prompt: str
    reference: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]


def exact_match(completion: str, reference: str) -> float:
    return float(completion.strip() == reference.strip())


@dataclass
class SFTData:
    train: list[SFTExample]
    eval: list[SFTExample]
    score: Callable[[str, str], float]  # (generated completion, reference) -> 0..1
    num_dropped: int = 0


def build_data(config: SFTConfig, tokenizer: Tokenizer) -> SFTData:
    """Tokenize the built-in arithmetic task or ``config.data``; examples longer than ``max_seq_len`` are dropped."""
    if tokenizer.eos_id is None:
        raise ValueError("the tokenizer has no EOS token; SFT needs one to teach the model to stop")
    # (prompt text, prompt ids, reference completion). Raw prompts get the tokenizer's special tokens (BOS);
    # chat-rendered prompts already carry them, as HF chat templates write BOS themselves.
    rows_train: list[tuple[str, list[int], str]]
    rows_eval: list[tuple[str, list[int], str]]
    if config.data is None:
        task = ArithmeticTask(config.task)
        rows_train = [(e.prompt, tokenizer.encode(e.prompt), e.answer) for e in task.train]
        rows_eval = [(e.prompt, tokenizer.encode(e.prompt), e.answer) for e in task.test]
        score: Callable[[str, str], float] = reward
    else:
        rows = []
        for r in read_sft_jsonl(config.data):
            if r.messages is not None:
                prompt = tokenizer.apply_chat_template(r.messages[:-1], add_generation_prompt=True)
                rows.append((prompt, tokenizer.encode(prompt, add_special_tokens=False), r.messages[-1]["content"]))
            else:
                assert r.prompt is not None and r.completion is not None
                rows.append((r.prompt, tokenizer.encode(r.prompt), r.completion))
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(config.seed)).tolist()
        num_eval = max(1, int(len(rows) * config.eval_fraction)) if len(rows) > 1 else 0
        rows_eval = [rows[i] for i in order[:num_eval]]
        rows_train = [rows[i] for i in order[num_eval:]]
        score = exact_match

    dropped = 0

    def tokenize(rows: list[tuple[str, list[int], str]]) -> list[SFTExample]:
        nonlocal dropped
        completions = tokenizer.encode_batch([c for _, _, c in rows], add_special_tokens=False)
        out = []
        for (p, p_ids, c), c_ids in zip(rows, completions):
            if len(p_ids) + len(c_ids) + 1 > config.max_seq_len:
                dropped += 1
                continue
            out.append(SFTExample(p, c, tuple(p_ids), tuple(c_ids) + (tokenizer.eos_id,)))  # type: ignore[operator]
        return out

    train, evaluation = tokenize(rows_train), tokenize(rows_eval)
    if not train:
        raise ValueError(f"no training examples left (dropped {dropped} longer than --max-seq-len "
                         f"{config.max_seq_len}); raise --max-seq-len or check --data")
    return SFTData(train, evaluation, score, dropped)


def batch_indices(step: int, batch_size: int, num_examples: int, seed: int) -> list[int]:
    """Indices of the examples in step ``step``'s batch: consecutive slices of one seeded permutation per epoch."""
    out: list[int] = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_examples)
        perm = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        take = min(batch_size - len(out), num_examples - offset)
        out.extend(perm[offset:offset + take].tolist())
    return out


def collate(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids`` (B, T) and ``loss_mask`` (B, T-1), 1 where token t+1 is a completion token.

    With right padding, causal attention never lets a real token see a pad, so no attention mask is needed.
    """
    seqs = [e.prompt_ids + e.completion_ids for e in examples]
    t = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), t - 1), dtype=torch.float32)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        input_ids[i, :len(s)] = torch.tensor(s)
        # Targets input_ids[:, 1:]; the completion's first token is predicted at position len(prompt) - 1.
        loss_mask[i, len(e.prompt_ids) - 1:len(s) - 1] = 1.0
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def completion_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean next-token cross-entropy over completion tokens.

    logits (B, T, V), input_ids (B, T), loss_mask (B, T-1) -> scalar loss and stats (``num_tokens``).
    """
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    num_tokens = loss_mask.sum()
    loss = (nll * loss_mask.flatten()).sum() / num_tokens.clamp(min=1)
    return loss, {"num_tokens": float(num_tokens)}


Generate = Callable[[list[list[int]], int], list[str]]  # (prompt ids, max new tokens) -> completions


def plain_generate(model: Transformer, tokenizer: Tokenizer) -> Generate:
    """Greedy completions with the plain (non-paged) reference loop."""
    def run(prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        out = generate(model, prompts, max_new_tokens, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id or 0)
        return [tokenizer.decode(o) for o in out]
    return run


def engine_generate(model: Transformer, tokenizer: Tokenizer, max_model_len: int) -> Generate:
    """Greedy completions with the serving engine over the trained model's own weights (no copy). The engine's
    paged kernels fall back to dense attention for training forwards; the prefix cache is dropped before each
    evaluation because the weights changed since the last one."""
    from spinwheel.engine import LLM, SamplingParams

    llm = LLM(model, tokenizer, max_model_len=max_model_len)

    def run(prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        llm.update_weights(model)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
        return [o.outputs[0].text for o in outs]
    return run


def evaluate(generate_fn: Generate, data: SFTData, num_examples: int, max_new_tokens: int) -> dict[str, Any]:
    """Held-out score with greedy decoding: mean of ``data.score`` and a few (prompt, completion, reference)."""
    examples = data.eval[:num_examples]
    if not examples:
        return {"exact_match": None, "samples": []}
    completions = generate_fn([list(e.prompt_ids) for e in examples], max_new_tokens)
    scores = [data.score(c, e.reference) for c, e in zip(completions, examples)]
    samples = [(e.prompt, c, e.reference) for e, c in zip(examples[:8], completions)]
    return {"exact_match": sum(scores) / len(scores), "samples": samples}


def _build_model(config: SFTConfig, tokenizer: Tokenizer, checkpoint: Path) -> Transformer:
    source: str | Path = checkpoint if checkpoint.is_dir() and config.resume else config.model
    torch.manual_seed(config.seed)
    return load_model(source, dtype=config.dtype, device=config.device, seed=config.seed,
                      vocab_size=tokenizer.vocab_size)


class Learner(Protocol):
    """What the SFT loop steps: owns the trainable state, saves and restores it, and keeps the model that
    evaluation reads up to date."""

    is_main: bool  # logs, evaluates and writes the checkpoint's HF files
    distributed: bool
    eval_model: Transformer | None  # what evaluation generates with (None on ranks that do not evaluate)

    def load(self, state: dict[str, Any], ckpt_dir: Path) -> None: ...
    def train_step(self, batch: dict[str, torch.Tensor], lr: float) -> tuple[float, float]: ...  # loss, grad norm
    def sync_eval_model(self) -> None: ...
    def save(self, ckpt_dir: Path, tokenizer: Tokenizer, state: dict[str, Any]) -> None: ...


class LocalLearner:
    """Single-process training: the model and its AdamW, stepped in this process — the reference every parallel
    layout is compared against."""

    is_main = True
    distributed = False

    def __init__(self, config: SFTConfig, model: Transformer) -> None:
        self.config, self.model = config, model
        self.optimizer = build_adamw(model, config.lr, config.weight_decay)
        self.eval_model = model  # evaluation reads the training weights themselves

    def load(self, state: dict[str, Any], ckpt_dir: Path) -> None:
        if "optimizer" not in state:
            raise ValueError(f"{ckpt_dir} was written by a parallel run: resume it under torchrun with the same "
                             "layout, or start over with --no-resume")
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])

    def train_step(self, batch: dict[str, torch.Tensor], lr: float) -> tuple[float, float]:
        set_lr(self.optimizer, lr)
        logits = self.model(batch["input_ids"])
        loss, _ = completion_loss(logits, batch["input_ids"], batch["loss_mask"])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        self.optimizer.step()
        return float(loss.detach()), grad_norm

    def sync_eval_model(self) -> None:
        pass

    def save(self, ckpt_dir: Path, tokenizer: Tokenizer, state: dict[str, Any]) -> None:
        save_checkpoint(ckpt_dir, self.model, tokenizer,
                        {**state, "optimizer": self.optimizer.state_dict(), "rng": rng_state()})


def train_sft(config: SFTConfig, on_eval: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run SFT as configured; returns the final metrics (``eval_before``, ``eval_after``, ``losses``, ...).

    Under ``torchrun`` with more than one process this trains on the parallel trainer (``config.parallel``);
    otherwise in this process, where only a layout of degree 1 fits.
    """
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if launched_world_size() > 1:
        from spinwheel.train.parallel_sft import train_sft_parallel

        return train_sft_parallel(config, on_eval)
    config.parallel.make_dims()  # raises a readable error for e.g. --tp 2 without torchrun
    return run_sft(config, LocalLearner, on_eval)


def run_sft(config: SFTConfig, make_learner: Callable[[SFTConfig, Transformer], Learner],
            on_eval: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The SFT loop over the learner ``make_learner(config, model)`` builds (see :func:`train_sft`)."""
    out_dir = Path(config.out_dir)
    ckpt_dir = out_dir / "checkpoint"
    state = load_trainer_state(ckpt_dir) if config.resume and ckpt_dir.is_dir() else None
    tokenizer = load_tokenizer(ckpt_dir if state is not None else config.model)
    model = _build_model(config, tokenizer, ckpt_dir if state is not None else Path("/nonexistent"))
    num_params = sum(p.numel() for p in set(model.parameters()))
    data = build_data(config, tokenizer)
    learner = make_learner(config, model)
    start_step = 0
    if state is not None:
        learner.load(state, ckpt_dir)
        start_step = int(state["step"])
    logger = MetricsLogger(out_dir, resume_step=start_step if state is not None else None) if learner.is_main \
        else None

    def log(record: dict[str, Any]) -> None:
        if logger is not None:
            logger.log(record)

    if state is None:
        log({"step": 0, "num_params": num_params, "num_train": len(data.train), "num_eval": len(data.eval),
             "num_dropped": data.num_dropped})

    result: dict[str, Any] = {"start_step": start_step}

    generate_fn: Generate | None = None
    if learner.eval_model is not None and config.eval_engine:
        longest = max((len(e.prompt_ids) for e in data.eval), default=1)
        generate_fn = engine_generate(learner.eval_model, tokenizer, longest + config.max_new_tokens + 1)
    elif learner.eval_model is not None:
        generate_fn = plain_generate(learner.eval_model, tokenizer)

    def run_eval(step: int) -> dict[str, Any] | None:
        learner.sync_eval_model()  # collective under torchrun: every rank calls it, rank 0 evaluates
        if generate_fn is None:
            return None
        ev = evaluate(generate_fn, data, config.eval_examples, config.max_new_tokens)
        log({"step": step, "eval_exact_match": ev["exact_match"]})
        if on_eval is not None:
            on_eval(step, ev)
        return ev

    if start_step == 0 and (ev := run_eval(0)) is not None:
        result["eval_before"] = ev

    def save(step: int) -> None:
        learner.save(ckpt_dir, tokenizer, {"step": step, "config": dataclasses.asdict(config)})

    end_step = config.steps if config.stop_after is None else min(config.steps, start_step + config.stop_after)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(start_step, end_step), total=config.steps, initial=start_step,
               disable=not (config.progress and learner.is_main), desc="sft", dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 10.0)  # logs (not a terminal) get a line per 10 s
    t0, tokens = time.perf_counter(), 0.0
    step = start_step
    try:
        for step in bar:
            batch = collate([data.train[i] for i in batch_indices(step, config.batch_size, len(data.train),
                                                                  config.seed)], tokenizer.pad_id or 0)
            batch = {k: v.to(config.device) for k, v in batch.items()}
            lr = lr_at(step, config.lr, config.warmup_steps, config.steps, config.min_lr_ratio)
            loss, grad_norm = learner.train_step(batch, lr)
            tokens += float(batch["loss_mask"].sum())
            losses.append(loss)
            record = {"step": step + 1, "loss": losses[-1], "lr": lr, "grad_norm": grad_norm,
                      "completion_tokens_per_s": tokens / (time.perf_counter() - t0)}
            log(record)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{lr:.2e}", refresh=False)  # drawn at mininterval
            done = step + 1
            if config.eval_every and done % config.eval_every == 0 and done < config.steps:
                if (ev := run_eval(done)) is not None:
                    bar.write(f"step {done}: held-out exact match {ev['exact_match']:.3f}")
            if config.save_every and done % config.save_every == 0 and done < end_step:
                save(done)
        step = end_step
    except KeyboardInterrupt:
        bar.close()
        if learner.distributed:  # peers may be mid-collective: keep the last periodic checkpoint
            raise
        done_steps = start_step + len(losses)
        save(done_steps)
        print(f"interrupted: checkpoint saved at step {done_steps} in {ckpt_dir}; rerun the same command to resume")
        raise
    bar.close()
    save(end_step)
    result.update(losses=losses, end_step=end_step, checkpoint=str(ckpt_dir))
    if end_step == config.steps and (ev := run_eval(end_step)) is not None:
        result["eval_after"] = ev
    if logger is not None:
        plot_curves(logger.read(), out_dir / "curves.png",
                    [("loss", "train loss (completion tokens)"), ("eval_exact_match", "held-out exact match")],
                    title=f"SFT {config.model}")
    return result
