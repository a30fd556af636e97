"""Resume's config comparison: what counts as a change, and checkpoints from before an option changed its type."""

from __future__ import annotations

import pytest

from spinwheel.train.resume import check_resume, config_changes
from spinwheel.train.sft.sft import RESUME_HARMLESS


def test_changes_are_listed_with_their_command_line_names():
    stored = {"lr": 1e-3, "steps": 10, "parallel": {"dp": 2, "remat": "none"}, "task": {"num_train": 5}}
    new = {"lr": 2e-3, "steps": 10, "parallel": {"dp": 1, "remat": "none"}, "task": {"num_train": 6}, "extra": 1}
    assert [str(c) for c in config_changes(stored, new)] == [
        "--lr 0.001 -> 0.002",
        "--dp 2 -> 1",
        "--task-num-train 5 -> 6",
    ]


@pytest.mark.parametrize("old, new, changed", [(False, "none", False), (True, "block", False), (False, "block", True)])
def test_a_boolean_remat_from_older_checkpoints_reads_as_its_mode(old, new, changed):
    changes = config_changes({"parallel": {"remat": old}}, {"parallel": {"remat": new}})
    assert bool(changes) is changed


def test_remat_changes_memory_not_the_run_so_resume_takes_it():
    stored = {"lr": 1e-3, "parallel": {"remat": "none", "remat_k": None, "remat_partition": "none"}}
    new = {"lr": 1e-3, "parallel": {"remat": "every-k", "remat_k": 2, "remat_partition": "tp"}}
    changes = check_resume(stored, new, RESUME_HARMLESS, force=False, where="ckpt")
    assert {c.key for c in changes} == {"parallel.remat", "parallel.remat_k", "parallel.remat_partition"}
    with pytest.raises(ValueError, match=r"ckpt was trained with other settings \(--lr 0.001 -> 0.002\)"):
        check_resume(stored, {**new, "lr": 2e-3}, RESUME_HARMLESS, force=False, where="ckpt")
