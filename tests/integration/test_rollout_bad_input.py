"""Bad input to a rollout node ends it early with an error that names the problem (no vLLM started)."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from streamrl.engine import config
from streamrl.engine.transport import TrajectoryReceiver
from streamrl.rollout.main import main


def _dead_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _cfg(**sections) -> config.Config:
    return config.build({"run": {"device": "cpu"}, "transport": {"send_timeout_s": 1.0}, **sections})


def test_unreachable_learner_fails_within_the_timeout_naming_the_address(caplog):
    addr = _dead_addr()
    start = time.monotonic()
    with caplog.at_level(logging.ERROR):
        assert main(_cfg(), addr, node_id="n") == 1
    assert time.monotonic() - start < 30  # 1 s timeout; slack for a loaded machine
    assert addr in caplog.text and "within 1s" in caplog.text


def test_temperature_with_top_p_is_rejected_before_the_engine_starts(caplog, tiny_model):
    cfg = _cfg(
        model={"path": tiny_model}, rollout={"temperature": 0.7, "top_p": 0.9, "backend": "vllm"}, reward={"workers": 0}
    )
    with TrajectoryReceiver() as receiver, caplog.at_level(logging.ERROR):
        assert main(cfg, receiver.addr, node_id="n") == 2
        assert receiver.recv(0.1) is None
    assert "rollout.temperature = 0.7" in caplog.text and "top_p = 0.9" in caplog.text


def test_missing_prompt_file_names_the_field(caplog, tiny_model, tmp_path):
    cfg = _cfg(model={"path": tiny_model}, data={"path": str(tmp_path / "nope.jsonl")}, reward={"workers": 0})
    with TrajectoryReceiver() as receiver, caplog.at_level(logging.ERROR):
        assert main(cfg, receiver.addr, node_id="n") == 2
    assert "data.path" in caplog.text and "nope.jsonl" in caplog.text


def test_missing_model_folder_is_named(caplog, tmp_path):
    cfg = _cfg(model={"path": str(tmp_path / "no-model")}, reward={"workers": 0})
    with TrajectoryReceiver() as receiver, caplog.at_level(logging.ERROR):
        assert main(cfg, receiver.addr, node_id="n") == 2
    assert "no-model" in caplog.text and "does not exist" in caplog.text


@pytest.mark.parametrize("override", ["rollout.group_size=0", "rollout.backend=onnx", "rollout.top_p=1.5"])
def test_bad_rollout_config_names_the_field(override):
    with pytest.raises(config.ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        config.build({}, [override])
