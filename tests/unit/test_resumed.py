"""ops/resumed.py: a resumed run's config is its folder's config.toml with the command line on top, each change
named; a field its checkpoints pin is refused naming it; a folder without config.toml leaves the command line."""

from __future__ import annotations

import pytest

from streamrl.engine.config import ConfigError, build, dump
from streamrl.ops.resumed import resumed_config


@pytest.fixture
def run_dir(tmp_path):
    """A run folder as a first launch left it: its effective config, with the embedded Redis's URL."""
    first = build({}, [f"run.dir='{tmp_path}'", "run.name='r'", "run.steps=6", "learner.lr=0.005",
                       "ledger.url='redis://:secret@127.0.0.1:7001/0'"])  # fmt: skip
    (tmp_path / "r" / "redis").mkdir(parents=True)
    (tmp_path / "r" / "config.toml").write_text(dump(first))
    return tmp_path


def test_the_folders_config_is_the_base_and_changes_are_named(run_dir, tmp_path):
    extra = tmp_path / "extra.toml"
    extra.write_text("[rollout]\ngroup_size = 2\n")
    cfg, line = resumed_config(extra, [f"run.dir='{run_dir}'", "run.name='r'", "learner.lr=0.002"])
    assert (cfg.run.steps, cfg.learner.lr, cfg.rollout.group_size) == (6, 0.002, 2)
    assert cfg.ledger.url == ""  # the earlier launch's embedded Redis: the launcher starts its own
    assert line.endswith("changed on the command line: learner.lr 0.005 -> 0.002; rollout.group_size 4 -> 2")


def test_nothing_given_changes_nothing(run_dir):
    cfg, line = resumed_config(None, [f"run.dir='{run_dir}'", "run.name='r'"])
    assert cfg.learner.lr == 0.005 and line.endswith("changed on the command line: nothing")


@pytest.mark.parametrize("pinned", ["model.path='/elsewhere'", "lora.enabled=true"])
def test_a_pinned_field_is_refused_naming_it(run_dir, pinned):
    with pytest.raises(ConfigError, match=rf"^{pinned.split('=')[0]} cannot change on a resume"):
        resumed_config(None, [f"run.dir='{run_dir}'", "run.name='r'", pinned])


def test_a_folder_without_its_config_leaves_the_command_line(tmp_path):
    assert resumed_config(None, [f"run.dir='{tmp_path}'", "run.name='none'"]) is None
