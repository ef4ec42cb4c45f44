"""A node's control thread: a weight update cut short by the node's own stop is no failure; one that
fails while the node runs is an error."""

from __future__ import annotations

import concurrent.futures
import logging
import types

from streamrl.rollout.control import ControlLoop


def test_a_weight_update_cancelled_by_the_stop_is_reported_without_an_error_line(caplog):
    control = ControlLoop.__new__(ControlLoop)  # _outcome reads only the node and the stop's reason
    control.node, control.stop_reason = types.SimpleNamespace(node_id="n", stopping=False), ""
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.cancel()  # what run_coroutine_threadsafe's future is once the stopping node's loop cancels the update
    with caplog.at_level(logging.INFO, logger="streamrl.rollout"):
        applied = control._outcome(types.SimpleNamespace(version=6), done)
    assert (applied.node_id, applied.version, applied.error) == ("n", 6, "the node is stopping")
    assert [r.levelname for r in caplog.records] == ["INFO"]  # once a traceback logged at ERROR from the callback


def test_an_engine_that_died_under_the_stop_is_info_and_one_that_died_running_is_an_error(caplog):
    control = ControlLoop.__new__(ControlLoop)
    control.node, control.stop_reason = types.SimpleNamespace(node_id="n", stopping=True), ""
    dead: concurrent.futures.Future = concurrent.futures.Future()
    dead.set_exception(RuntimeError("EngineCore encountered an issue"))
    with caplog.at_level(logging.INFO, logger="streamrl.rollout"):
        applied = control._outcome(types.SimpleNamespace(version=6), dead)
        control.node.stopping = False
        control._outcome(types.SimpleNamespace(version=7), dead)
    assert applied.error == "RuntimeError: EngineCore encountered an issue"  # the learner still learns why
    assert [r.levelname for r in caplog.records] == ["INFO", "ERROR"]
