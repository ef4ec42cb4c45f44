"""Bad input to a rollout node ends it early with an error that names the problem (no vLLM started)."""

from __future__ import annotations

import socket
import time

import pytest

from streamrl.engine import config
from streamrl.rollout.service import main


def _dead_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _cfg(tmp_path, **sections) -> config.Config:
    run = {"device": "cpu", "dir": str(tmp_path), "name": "bad"}
    return config.build({"run": run, "transport": {"send_timeout_s": 1.0, "curve": False}, **sections})


def _node_log(tmp_path) -> str:
    return (tmp_path / "bad" / "logs" / "rollout-n.log").read_text()


def test_unreachable_learner_fails_within_the_timeout_naming_the_address(tmp_path):
    addr = _dead_addr()
    start = time.monotonic()
    assert main(_cfg(tmp_path), addr, node_id="n") == 1
    assert time.monotonic() - start < 30  # 1 s timeout; slack for a loaded machine
    log = _node_log(tmp_path)
    assert addr in log and "within 1s" in log and "streamrl rollout --learner" in log


def test_missing_prompt_file_names_the_field(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, model={"path": tiny_model}, data={"path": str(tmp_path / "nope.jsonl")}, reward={"workers": 0})
    assert main(cfg, _dead_addr(), node_id="n") == 2
    assert "data.path" in _node_log(tmp_path) and "nope.jsonl" in _node_log(tmp_path)


def test_missing_model_folder_is_named(tmp_path):
    cfg = _cfg(tmp_path, model={"path": str(tmp_path / "no-model")}, reward={"workers": 0})
    assert main(cfg, _dead_addr(), node_id="n") == 2
    assert "no-model" in _node_log(tmp_path) and "does not exist" in _node_log(tmp_path)


@pytest.mark.parametrize("override", ["rollout.group_size=0", "rollout.backend=onnx", "rollout.top_p=1.5"])
def test_bad_rollout_config_names_the_field(override):
    with pytest.raises(config.ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        config.build({}, [override])
