"""Verifiable tasks with rewards (built-in arithmetic) and JSONL readers for user data."""

from spinwheel.tasks.arithmetic import (
    OPERATORS,
    ArithmeticConfig,
    ArithmeticTask,
    EvalResult,
    Example,
    evaluate,
    extract_answer,
    reward,
)
from spinwheel.tasks.data import (
    ROLES,
    SAMPLES_DIR,
    DataError,
    PreferenceRecord,
    RLRecord,
    SFTRecord,
    read_preference_jsonl,
    read_rl_jsonl,
    read_sft_jsonl,
    write_jsonl,
)

__all__ = [
    "OPERATORS",
    "ArithmeticConfig",
    "ArithmeticTask",
    "EvalResult",
    "Example",
    "evaluate",
    "extract_answer",
    "reward",
    "ROLES",
    "SAMPLES_DIR",
    "DataError",
    "PreferenceRecord",
    "RLRecord",
    "SFTRecord",
    "read_preference_jsonl",
    "read_rl_jsonl",
    "read_sft_jsonl",
    "write_jsonl",
]
