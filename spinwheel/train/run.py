"""The run harness every training command runs on (SFT, the LLM RL commands, DPO, reward models).

A command supplies a :class:`Job`: what differs between commands — one step that returns the step's record, an
evaluation, and what its checkpoint holds. The harness owns everything else, the same way for every command:

* the output directory, held by one run at a time (:mod:`~spinwheel.train.run_dir`);
* resume: the checkpoint's stored options against this run's (:mod:`~spinwheel.train.resume`; ``--force``), a
  finished run says so and does nothing;
* ``metrics.jsonl`` (main rank; a resumed run drops the rows after its step), ``curves.png``, the progress bar;
* evaluation and checkpoint cadence (``eval_every``, ``save_every``, ``stop_after``), atomic checkpoints;
* one interrupt behaviour: SIGINT / SIGTERM let the current step finish, every rank agrees on the step, the
  checkpoint of that step is written and :class:`~spinwheel.train.interrupt.Interrupted` ends the command with
  130 / 143 and one line; a second Ctrl-C quits at once (:mod:`~spinwheel.train.interrupt`);
* nothing broken is ever saved: a step whose loss or gradient norm is not finite, or parameters that are not,
  stop the run with :class:`NonFiniteError` naming the step and the value, and the last good checkpoint stays
  the latest; a step that fails in user code (:class:`StepFailed`, e.g. a reward function that raises) first
  saves the steps before it.

The step functions read as their algorithms; the bookkeeping lives here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from spinwheel.threads import fit_threads
from spinwheel.train.checkpoint import load_trainer_state, recover_interrupted_save, write_failure
from spinwheel.train.interrupt import Interrupted, StopOnSignal, any_rank
from spinwheel.train.learners import Learner, is_main_process
from spinwheel.train.metrics import MetricsLogger, plot_curves
from spinwheel.train.report import check_backend, open_reporter
from spinwheel.train.resume import OBSERVATION_OPTIONS, finished_message, resume_message, resume_point
from spinwheel.train.run_dir import RunDirError, RunDirLock, prepare_out_dir

# Keys of a step's record that must be finite: a NaN or inf there means the weights are (or are about to be) broken.
GUARDED = ("loss", "grad_norm", "critic_grad_norm", "value_loss")


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or parameter went non-finite; the run stopped without saving it."""


class StepFailed(Exception):
    """Raised by a step when code outside the trainer failed before the step changed any weight (``cause``: the
    user's error, re-raised after the checkpoint of the steps before is written). Every rank raises it together."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Job(Protocol):
    """What a command supplies to :meth:`Run.train`."""

    learner: Learner

    def step(self, step: int) -> dict[str, Any]:
        """Train step ``step`` (0-based); returns its record (the harness adds ``"step": step + 1`` and logs it)."""
        ...

    def evaluate(self, step: int) -> Any:
        """Held-out figures after ``step`` steps (a collective: every rank calls it); logged by the job. Returns
        what the command reports (None: nothing evaluated on this rank)."""
        ...

    def save(self, ckpt_dir: Path, state: dict[str, Any]) -> None:
        """Write the checkpoint (collective) with ``state`` (step, config) and what else the job keeps."""
        ...


def describe(value: Any, label: str = "exact match") -> str:
    """An evaluation's figures as the progress line shows them (``label``: what a single figure is)."""
    if isinstance(value, float):
        return f"held-out {label} {value:.3f}"
    if isinstance(value, dict):
        shown = {("held-out exact match" if k == "exact_match" else k): v for k, v in value.items()}
        return ", ".join(f"{k} {v:.3f}" for k, v in shown.items() if isinstance(v, float))
    return str(value)


def nonfinite(record: dict[str, Any]) -> str | None:
    """The first guarded figure of ``record`` that is not finite, as ``name = value``; None when all are."""
    for key in GUARDED:
        v = record.get(key)
        if isinstance(v, float) and not math.isfinite(v):
            return f"{key} = {v}"
    return None


class Run:
    """One training run's directory, resume point, log and loop (see the module docstring).

    ``config`` is the command's options dataclass: ``out_dir``, ``steps``, ``stop_after``, ``eval_every``,
    ``save_every``, ``resume``, ``force``, ``progress``, ``min_lr_ratio``. ``harmless``: options whose change keeps
    a resumed run exact. Use as a context manager: the directory's lock is held until it exits.
    """

    def __init__(
        self,
        config: Any,
        distributed: bool,
        desc: str,
        harmless: Collection[str] = OBSERVATION_OPTIONS,
    ) -> None:
        self.config, self.distributed, self.desc = config, distributed, desc
        self.out_dir = Path(config.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoint"
        self.is_main = is_main_process()
        self._lock = RunDirLock(self.out_dir)
        self._harmless = harmless
        self.state: dict[str, Any] | None = None
        self.start_step, self.changes = 0, []
        self.logger: MetricsLogger | None = None
        self.last_saved: int | None = None
        self._stop: StopOnSignal | None = None
        self.reached: int | None = None  # the step whose evaluation met train()'s ``until``
        self._reached_eval: Any = None

    def stop_requested(self) -> bool:
        """Whether SIGINT / SIGTERM arrived during this run's steps (for waits in user code, e.g. reward calls)."""
        return self._stop is not None and self._stop.signum is not None

    def __enter__(self) -> Run:
        check_backend(self.config.report_to)  # a missing --report-to package: one line before anything starts
        self._created = not self.out_dir.exists()
        self._open_dir()
        c = self.config
        try:
            self.state = load_trainer_state(self.ckpt_dir) if c.resume and self.ckpt_dir.is_dir() else None
            if self.state is not None:
                self.start_step, self.changes = resume_point(c, self.state, self.ckpt_dir, self._harmless)
                self.last_saved = self.start_step
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.logger is not None:
            self.logger.close()
        self._lock.release()
        if self._created:  # a run refused before it wrote anything leaves no empty --out-dir behind
            with contextlib.suppress(OSError):
                self.out_dir.rmdir()

    def _open_dir(self) -> None:
        """Rank 0 takes the directory's lock; every rank learns whether that worked (so all fail together)."""
        error: RunDirError | None = None
        if self.is_main:
            try:
                self._lock.acquire()
            except RunDirError as e:
                error = e
            except OSError as e:  # mkdir or the lock file: EACCES, EROFS, ENOTDIR, ENOSPC ...
                error = RunDirError(f"--out-dir {self.out_dir} cannot be created or written ({e}); choose another")
            try:
                if error is None and (moved := recover_interrupted_save(self.ckpt_dir)) is not None:
                    print(f"{self.ckpt_dir}: put back from {moved.name} (a save was killed mid-way)", flush=True)
            except OSError as e:  # the put-back failed: resuming without it would start over
                error = RunDirError(f"{self.ckpt_dir} is missing and its copy beside it cannot be put back: {e}")
        if any_rank(error is not None, self.distributed):
            raise error or RunDirError(f"--out-dir {self.out_dir} cannot be used (rank 0 says why)")
        if not self.is_main:
            prepare_out_dir(self.out_dir)

    @property
    def resumed(self) -> bool:
        return self.state is not None

    def finished(self) -> bool:
        """The checkpoint is already at ``--steps``: nothing to do (the main rank says so)."""
        done = self.state is not None and self.start_step == self.config.steps
        if done and self.is_main:
            print(finished_message(self.start_step, self.config.steps, self.ckpt_dir), flush=True)
        return done

    def finished_result(self) -> dict[str, Any]:
        return {
            "start_step": self.start_step,
            "end_step": self.start_step,
            "finished": True,
            "checkpoint": str(self.ckpt_dir),
        }

    def announce_resume(self) -> None:
        if self.state is not None and self.is_main:
            print(resume_message(self.start_step, self.config.steps, self.ckpt_dir, self.changes), flush=True)

    @property
    def end_step(self) -> int:
        c = self.config
        if self.reached is not None:
            return self.reached
        return c.steps if c.stop_after is None else min(c.steps, self.start_step + c.stop_after)

    def open_log(self, is_main: bool) -> None:
        """Open ``metrics.jsonl`` on the main rank (a resumed run keeps the rows up to its step), and the
        ``--report-to`` reporter that mirrors it."""
        if is_main:
            c = self.config
            reporter = open_reporter(c.report_to, self.out_dir, dataclasses.asdict(c), f"{self.desc} {self.out_dir}")
            self.logger = MetricsLogger(self.out_dir, self.start_step if self.resumed else None, reporter)

    def log(self, record: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(record)

    def save(self, job: Job, step: int) -> None:
        """Write the checkpoint of ``step`` unless a parameter is not finite on any rank (then raise)."""
        bad = not job.learner.params_finite()
        if any_rank(bad, self.distributed):
            raise NonFiniteError(self._broken(step, "a parameter is not finite"))
        try:
            job.save(self.ckpt_dir, {"step": step, "config": dataclasses.asdict(self.config)})
        except RuntimeError as e:  # torch.save's failed write (a full disk): one line (an OSError), else as it was
            if (failed := write_failure(e, self.ckpt_dir)) is None:
                raise
            raise failed from e
        self.last_saved = step
        if figures := getattr(job.learner, "save_stats", None):  # a streamed parallel save's figures, by rank
            first = figures[0]
            row = {"step": step, "save_model_mb": first["save_model_mb"], "save_s": first["save_s"]}
            self.log(row | {f"save_peak_mb/rank{r}": f["save_peak_mb"] for r, f in enumerate(figures)})

    def _broken(self, step: int, what: str) -> str:
        kept = (
            f"the last good checkpoint ({self.ckpt_dir}, step {self.last_saved}) stays the latest"
            if self.last_saved is not None
            else "no checkpoint was written"
        )
        return f"step {step}: {what}; the run stopped without saving: {kept}"

    def train(
        self,
        job: Job,
        curves: list[tuple[str, str]],
        title: str,
        postfix: Callable | None = None,
        until: Callable[[Any], bool] | None = None,
    ) -> dict:
        """Steps ``start_step`` .. :attr:`end_step` of ``job`` with evaluation before (a new run) and after (a
        finished one); returns ``start_step``, ``end_step``, ``history``, ``checkpoint``, ``eval_before``,
        ``eval_after`` (what :meth:`Job.evaluate` returned). ``until``: a test of a periodic evaluation's figures;
        the first one that passes it ends the run there (saved; that evaluation is ``eval_after``), which makes a
        stage's end a level reached rather than a step count that rounding can land anywhere on the curve."""
        result: dict[str, Any] = {"start_step": self.start_step}
        if not self.resumed and (ev := job.evaluate(0)) is not None:
            result["eval_before"] = ev
        history = self._loop(job, postfix, until)
        self.save(job, self.end_step)
        result.update(history=history, end_step=self.end_step, checkpoint=str(self.ckpt_dir))
        if self.reached is not None:
            result.update(eval_after=self._reached_eval, reached=self.reached)
        elif self.end_step == self.config.steps and (ev := job.evaluate(self.end_step)) is not None:
            result["eval_after"] = ev
        if self.logger is not None:
            plot_curves(self.logger.read(), self.out_dir / "curves.png", curves, title=title)
        return result

    def progress_bar(self, is_main: bool) -> tqdm:
        """The steps of this run as a progress bar (logs that are not a terminal get a line per 10 s)."""
        c = self.config
        return tqdm(
            range(self.start_step, self.end_step),
            total=c.steps,
            initial=self.start_step,
            desc=self.desc,
            disable=not (c.progress and is_main),
            dynamic_ncols=True,
            mininterval=1.0 if sys.stderr.isatty() else 10.0,
        )

    def _loop(self, job: Job, postfix: Callable | None, until: Callable[[Any], bool] | None) -> list[dict[str, Any]]:
        c, end = self.config, self.end_step
        history: list[dict[str, Any]] = []
        bar = self.progress_bar(job.learner.is_main)
        with StopOnSignal(self.distributed) as stop:
            self._stop = stop
            for step in bar:
                fit_threads()  # fewer threads while other processes hold cores (spinwheel.threads)
                started = time.perf_counter()
                try:
                    record = {"step": step + 1, **job.step(step)}
                except StepFailed as e:
                    bar.close()
                    self._save_before_failure(job, step, stop, e.cause)
                    raise e.cause from None
                record.setdefault("time/step", time.perf_counter() - started)  # wall seconds (the curves' step time)
                bad = nonfinite(record)
                signum, any_bad = stop.agree(bad is not None)
                if any_bad:
                    bar.close()
                    raise NonFiniteError(self._broken(step + 1, f"{bad or 'a figure'} is not finite"))
                self.log(record)
                history.append(record)
                if postfix is not None:
                    bar.set_postfix(postfix(record), refresh=False)
                done = step + 1
                if done < end and signum is not None:  # every rank stops after this step
                    bar.close()
                    self.save(job, done)
                    raise stop.interrupted(signum, done, self.ckpt_dir, self.is_main, c.resume)
                if c.eval_every and done % c.eval_every == 0 and done < c.steps:
                    if (ev := job.evaluate(done)) is not None:
                        bar.write(f"step {done}: {describe(ev, getattr(job, 'eval_label', 'exact match'))}")
                    if until is not None and any_rank(ev is not None and until(ev), self.distributed):
                        self.reached, self._reached_eval = done, ev  # every rank ends here; rank 0 holds ev
                        break
                if c.save_every and done % c.save_every == 0 and done < end:
                    self.save(job, done)
        bar.close()
        self._stop = None
        return history

    def _save_before_failure(self, job: Job, step: int, stop: StopOnSignal, cause: BaseException) -> None:
        """A step failed before changing any weight: save the steps before it; a wait stopped by Ctrl-C ends as an
        interrupted run (130 / 143), anything else says the checkpoint is there and lets the error speak."""
        if step == self.start_step:  # nothing trained since the last checkpoint (or the start)
            if isinstance(cause, KeyboardInterrupt):
                raise Interrupted(stop.signum or signal.SIGINT, step) from None
            return
        self.save(job, step)
        if isinstance(cause, KeyboardInterrupt):
            signum = stop.signum or signal.SIGINT
            raise stop.interrupted(signum, step, self.ckpt_dir, self.is_main, self.config.resume) from None
        if self.is_main:
            print(f"checkpoint saved at step {step} in {self.ckpt_dir} before the error below", flush=True)
