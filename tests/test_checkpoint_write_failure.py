"""A checkpoint write that fails for lack of space (torch.save's RuntimeError) is a one-line OSError naming the
checkpoint and the free space; other RuntimeErrors pass through."""

from pathlib import Path

import pytest
import torch

from spinwheel.train.checkpoint import write_failure


def test_full_disk_is_one_line(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    with pytest.raises(RuntimeError) as info:
        torch.save({"w": torch.zeros(10_000)}, "/dev/full")  # every write fails with ENOSPC
    err = write_failure(info.value, tmp_path / "run" / "checkpoint")
    assert isinstance(err, OSError)
    text = str(err)
    assert "\n" not in text and str(tmp_path / "run" / "checkpoint") in text and "MiB free" in text


def test_other_errors_pass_through(tmp_path: Path) -> None:
    assert write_failure(RuntimeError("Connection closed by peer"), tmp_path) is None
    assert write_failure(ValueError("bad"), tmp_path) is None


def test_lock_release_in_an_unwritable_dir_hides_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopping because its directory turned unwritable: releasing the lock must not raise over that error."""
    import os

    from spinwheel.train.run_dir import RunDirLock

    lock = RunDirLock(tmp_path).acquire()

    def refuse(path: object) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "unlink", refuse)
    lock.release()  # no raise; the lock is dropped
    monkeypatch.undo()
    RunDirLock(tmp_path).acquire().release()


def test_a_save_clears_what_a_killed_save_left(tmp_path: Path) -> None:
    """A process killed in the middle of a save leaves its temporary directory (or the copy it was replacing); the
    next complete save removes them and nothing else."""
    from spinwheel.models.hf import load_model
    from spinwheel.train.checkpoint import save_checkpoint

    ckpt = tmp_path / "checkpoint"
    for leftover in (".checkpoint.tmp-abc123", ".checkpoint.old-4242"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    save_checkpoint(ckpt, load_model("test", vocab_size=50), None, {"step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "metrics.jsonl"]
    assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"] == 1


def test_a_full_disk_in_a_streamed_save_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed safetensors writer's pwrite failing (ENOSPC says nothing of which file) names the file."""
    import errno
    import os

    from spinwheel.models.safetensors_file import SafetensorsWriter

    writer = SafetensorsWriter(tmp_path / "model.safetensors", {"w": (torch.float32, (4,))})

    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError) as info:
        writer.write("w", torch.ones(4))
    writer.close(check=False)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "model.safetensors")
    assert str(tmp_path / "model.safetensors") in str(info.value)
