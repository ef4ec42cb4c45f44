"""`streamrl doctor`'s rows for optional parts: a missing one is a warning naming what needs it and the
install command, never a failure (the installed case runs in tests/integration/test_doctor.py)."""

from __future__ import annotations

import importlib.util

from rich.console import Console

from streamrl.ops import doctor


def test_a_missing_optional_library_is_a_warning_with_its_install_command():
    check = doctor.check_optional("streamrl-absent", "streamrl_absent", "env.name = 'absent'", "pip install absent")
    assert (check.name, check.status, check.required) == ("streamrl-absent", "warn", False)
    assert (check.detail, check.fix) == ("not installed; needed for env.name = 'absent'", "pip install absent")
    console = Console(record=True, width=200)
    assert doctor.render([check], console) == 0  # warnings never fail the doctor


def test_tensorboard_on_by_default_but_missing_is_a_warning(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    check = doctor.check_tensorboard(enabled=True)
    assert (check.status, check.required) == ("warn", False)
    assert check.detail == "telemetry.tensorboard = true but tensorboard is not installed, so no events are written"
    assert check.fix == "pip install tensorboard (or set telemetry.tensorboard = false)"
    assert doctor.check_tensorboard(enabled=False).status in ("ok", "skip")


def test_the_optional_rows_are_in_every_doctor_run():
    names = [row[0] for row in doctor.OPTIONAL]
    assert names == ["wandb", "reasoning-gym", "skyrl-gym", "verifiers"]
    assert all(row[3].startswith("pip install 'streamrl[") for row in doctor.OPTIONAL)
