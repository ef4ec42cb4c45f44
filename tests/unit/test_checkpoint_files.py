"""Checkpoint folders without a model: retention, resolving `latest`, early failures."""

import pathlib

import pytest

from streamrl.learner import checkpoint


def fake(root: pathlib.Path, *steps: int, complete: bool = True) -> None:
    for step in steps:
        folder = root / f"step_{step}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "meta.json").write_text("{}")


def steps(root):
    return [s for s, _ in checkpoint.list_checkpoints(root)]


def test_keep_last_and_keep_every(tmp_path):
    fake(tmp_path, 2, 4, 6, 8, 10, 12)
    gone = checkpoint.prune(tmp_path, keep_last=2, keep_every=4)
    # newest two: 10, 12; multiples of 4: 4, 8, 12 → kept 4, 8, 10, 12; deleted 2, 6
    assert steps(tmp_path) == [4, 8, 10, 12]
    assert sorted(p.name for p in gone) == ["step_2", "step_6"]
    assert not (tmp_path / "step_2").exists()


def test_latest_ignores_incomplete_and_temporary_folders(tmp_path):
    fake(tmp_path / "checkpoints", 3, 10)
    fake(tmp_path / "checkpoints", 20, complete=False)  # killed mid-save: no meta.json
    (tmp_path / "checkpoints" / ".tmp-step_30").mkdir()
    latest = checkpoint.resolve("latest", tmp_path)
    assert latest.name == "step_10"
    assert checkpoint.resolve(tmp_path) == latest  # a run folder: its newest
    assert checkpoint.resolve(tmp_path / "checkpoints" / "step_3").name == "step_3"
    assert checkpoint.prune(tmp_path / "checkpoints", keep_last=1) == [tmp_path / "checkpoints" / "step_3"]


def test_no_checkpoint_names_the_folder(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match=f"no complete checkpoint at {tmp_path}"):
        checkpoint.resolve("latest", tmp_path)


def test_unwritable_folder_fails_early(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(checkpoint.CheckpointError, match="a-file/checkpoints is not writable.*run.dir"):
        checkpoint.check_writable(blocker / "checkpoints", need_bytes=1)


def test_not_enough_disk_says_how_much(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match=r"not enough disk.*MiB needed, .* MiB free"):
        checkpoint.check_writable(tmp_path, need_bytes=1 << 60)
    checkpoint.check_writable(tmp_path, need_bytes=1)  # room for a byte: no error


def test_unreadable_meta_is_named(tmp_path):
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="meta.json: not a readable streamrl checkpoint"):
        checkpoint.read_meta(tmp_path)
