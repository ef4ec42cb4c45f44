"""Preflight warns when the run folder's disk has less room than the run will write (ops/disk.py): the
ledger's append-only file, logs, checkpoints at the configured cadence, exports."""

from __future__ import annotations

import shutil

from streamrl.engine.config import build
from streamrl.ops import disk
from streamrl.ops import preflight as pf


def _cfg(tiny_model, tmp_path, *sets):
    return build({}, [f"model.path={tiny_model!r}", "run.device='cpu'", f"run.dir='{tmp_path}'", *sets])


def test_the_ledger_estimate_bounds_the_measured_file():
    # the demo: 3,840 samples grew the file to 8.3 MB (1.18x below 3,840 x 2,560 B = 9.8 MB), never rewritten
    assert disk.ledger_bytes(3840) == 3840 * 2560
    # a long run: Redis rewrites past 64 MiB, so the file holds ~3 x 256 B a sample, not 2.5 KB
    # 3.2M samples: max(64 MiB, 2 x 3.2M x 256) + 3.2M x 256 = 1.64 GB + 0.82 GB
    assert disk.ledger_bytes(3_200_000) == 2 * 3_200_000 * 256 + 3_200_000 * 256


def test_a_run_that_fits_is_not_warned_about_and_one_that_does_not_is(tiny_model, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    fits = pf.preflight(_cfg(tiny_model, tmp_path, "run.steps=30"), roles=("learner",))
    assert [p for p in fits.problems if p.check == "disk"] == []
    # steps enough that the ledger alone outgrows the free space (768 B a sample, rewritten)
    defaults = _cfg(tiny_model, tmp_path)
    per_step = defaults.learner.groups_per_step * defaults.rollout.group_size
    steps = free // (768 * per_step) + 10_000
    report = pf.preflight(_cfg(tiny_model, tmp_path, f"run.steps={steps}"), roles=("learner",))
    (warning,) = [p for p in report.problems if p.check == "disk"]
    assert warning.level == "warning" and "\n" not in warning.message
    assert warning.message.startswith(f"the disk of {tmp_path} has ") and "ledger " in warning.message
    assert "free space, point run.dir elsewhere, or lower run.steps" in warning.message


def test_checkpoints_count_keep_last_plus_the_one_being_written(tiny_model, tmp_path):
    from transformers import AutoConfig

    cfg = _cfg(tiny_model, tmp_path, "run.steps=10", "checkpoint.keep_last=3")
    parts = disk.need(cfg, AutoConfig.from_pretrained(tiny_model), tiny_model)
    hf_config = AutoConfig.from_pretrained(tiny_model)
    one = disk.need(_cfg(tiny_model, tmp_path, "run.steps=10", "checkpoint.keep_last=1"), hf_config, tiny_model)
    one = one["checkpoints"] // 2
    assert parts["checkpoints"] == 4 * one and 1.5e6 < one < 2e6  # the tiny model's: 1.7 MB by du
    off = disk.need(_cfg(tiny_model, tmp_path, "checkpoint.budget=0"), AutoConfig.from_pretrained(tiny_model), "")
    assert off["checkpoints"] == 0
