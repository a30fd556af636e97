"""``--env reasoning-gym:NAME``: a `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ procedural
dataset as a one-step environment (optional: ``pip install 'spinwheel[envs]'``; offline once installed).

The dataset is ``reasoning_gym.create_dataset(NAME, seed=..., size=..., **options)`` — ``options`` are the
dataset's own configuration fields (``--env-arg min_terms=2``). The train split uses ``seed`` (default 0), the test
split ``seed +`` :data:`TEST_SEED_OFFSET` (the generators draw item ``i`` from ``seed + i``, so the two never share
a draw). Episode ``seed`` is item ``seed % size``: its first observation the item's ``question`` (raw text; rendered
with the chat template under ``--chat``), its reward the dataset's own ``score_answer(answer, entry)`` of the answer
extracted from the model's reply (``answer_extraction``, :mod:`spinwheel.envs.answers`; ``auto``: the last number
when the dataset's answers are numbers — judged on its first :data:`AUTO_SAMPLE` items —, else the last
``<answer>`` tag's content or the whole reply), checked as every reward is (one finite number). ``info``:
``correct`` (1.0 when the score is 1.0: an exact answer, not partial credit) and ``answered`` (1.0 when the
extraction found an answer). The expert answers with the item's ``answer``.

A task the built-in char model can learn: ``chain_sum`` with ``min_terms=2 max_terms=2 max_digits=2`` (two-term sums
and differences of 1–2 digit numbers; answers of at most 3 characters).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

from spinwheel.envs.answers import auto_extraction, extractor
from spinwheel.envs.base import EnvError, Segment
from spinwheel.envs.single import OneStepEnv, _current

TEST_SEED_OFFSET = 1 << 30
AUTO_SAMPLE = 50  # items whose answers decide what answer_extraction=auto extracts
INSTALL = "pip install 'spinwheel[envs]' (or pip install reasoning-gym)"


def _module() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise EnvError(f"--env reasoning-gym:...: reasoning-gym is not installed ({e}); {INSTALL}") from None
    return reasoning_gym


def dataset_options(name: str) -> list[str]:
    """The configuration fields dataset ``name`` takes, or an :class:`EnvError` naming the available datasets."""
    datasets = _module().factory.DATASETS
    if name not in datasets:
        shown = ", ".join(sorted(datasets))
        raise EnvError(f"--env reasoning-gym:{name}: reasoning-gym has no dataset {name!r}; it has: {shown}")
    return [f.name for f in dataclasses.fields(datasets[name][1])]


@functools.lru_cache(maxsize=8)
def _dataset(name: str, seed: int, size: int, options: tuple[tuple[str, Any], ...]) -> Any:
    return _module().create_dataset(name, seed=seed, size=size, **dict(options))


@functools.lru_cache(maxsize=8)
def _auto_extraction(name: str, seed: int, size: int, options: tuple[tuple[str, Any], ...]) -> str:
    data = _dataset(name, seed, size, options)
    return auto_extraction(data[i]["answer"] for i in range(min(AUTO_SAMPLE, len(data))))


class ReasoningGymEnv(OneStepEnv):
    """A reasoning-gym dataset (``dataset``: its registered name) scored by its own ``score_answer``."""

    name: ClassVar[str] = "reasoning-gym"

    def __init__(
        self,
        split: str = "train",
        dataset: str = "",
        seed: int = 0,
        size: int = 10000,
        answer_extraction: str = "auto",
        **options: Any,
    ):
        super().__init__(split)
        unknown = sorted(set(options) - set(dataset_options(dataset)))
        if unknown:
            raise EnvError(f"reasoning-gym dataset {dataset!r} has no option {unknown[0]!r}")
        self.dataset_name = dataset
        key = (dataset, seed + (TEST_SEED_OFFSET if split == "test" else 0), size, tuple(options.items()))
        self.data = _dataset(*key)
        if answer_extraction == "auto":  # numbers -> the last number, else tags or the whole reply (answers.py)
            answer_extraction = _auto_extraction(*key)
        self.answer_extraction = answer_extraction
        self.extract = extractor(answer_extraction)
        self.example: dict[str, Any] | None = None
        self.answered = False  # whether the extraction found an answer in the last scored reply

    def reset(self, seed: int) -> str:
        self.example = self.data[seed % len(self.data)]
        return self.example["question"]

    @classmethod
    def score_batch(cls, envs, texts, *, timeout_s=None, should_stop=None) -> list[float]:
        from spinwheel.rl.llm.rewards import check_rewards  # at call time: spinwheel.rl.llm imports the RL loop

        answers = [env.extract(text) for env, text in zip(envs, texts)]
        for env, answer in zip(envs, answers):
            env.answered = answer is not None
        values = [env.data.score_answer(answer, _current(env)) for env, answer in zip(envs, answers)]
        label = f"score_answer of reasoning-gym:{envs[0].dataset_name}" if envs else "score_answer"
        return check_rewards(values, texts, label).tolist()

    def info(self, reward: float) -> dict[str, float]:
        return {"correct": float(reward == 1.0), "answered": float(self.answered)}

    def expert(self, seed: int) -> list[Segment]:
        entry = self.data[seed % len(self.data)]
        return [Segment(entry["question"], model=False), Segment(str(entry["answer"]), model=True)]
