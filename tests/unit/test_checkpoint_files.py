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
    with pytest.raises(checkpoint.CheckpointError, match=f"no checkpoint at {tmp_path}/checkpoints: give a step_N"):
        checkpoint.resolve("latest", tmp_path)


def test_a_run_that_saved_no_checkpoint_is_told_how_to_save_one(tmp_path):
    """Issue 38: README's LoRA export of a run that saved none read `... or start without --resume`."""
    run = tmp_path / "runs" / "lora"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("[run]\nname = 'lora'\n\n[checkpoint]\nevery = 0\nbudget = 0.0\n")
    for spec in (run, run / "checkpoints", run / "checkpoints" / "step_30"):
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint.resolve(spec)
        assert str(e.value) == (
            f"run {run} saved no checkpoint (checkpoint.every = 0, checkpoint.budget = 0.0), or ended before its "
            "first: run it again with --set checkpoint.every=N (one every N steps and one at the last step)"
        )
    (run / "checkpoints" / "step_10").mkdir(parents=True)
    (run / "checkpoints" / "step_10" / "meta.json").write_text("{}")
    with pytest.raises(
        checkpoint.CheckpointError, match=f"no checkpoint at {run}/checkpoints/step_30; run {run} saved step_10$"
    ):
        checkpoint.resolve(run / "checkpoints" / "step_30")


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


def test_a_lora_base_is_written_as_an_absolute_folder(tmp_path, monkeypatch):
    """Issue 38: adapter_config.json named the base by the config's relative path, which names another folder
    (or none) wherever the adapter is loaded from; a hub id stays as given."""
    (tmp_path / "models" / "tiny-sharp").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert checkpoint.local_path("models/tiny-sharp") == str(tmp_path / "models" / "tiny-sharp")
    assert checkpoint.local_path("Qwen/Qwen2-0.5B") == "Qwen/Qwen2-0.5B"
    assert checkpoint.local_path("") == ""
