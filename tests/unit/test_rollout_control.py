"""A node's control thread: a weight update cut short by the node's own stop is no failure; one that
fails while the node runs is an error; a `RelayTo` reaches the node's relay and the relay's layouts go back to
the learner as `Relayed`."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
import types

from streamrl.engine.messages import Relayed, RelayTo, WeightsReady
from streamrl.engine.weights import Stager
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


class FakeControlClient:
    """Stands in for the node's `ControlClient`: `recv` hands out what the test queued, `send` keeps what the
    node sent to the learner."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.sent: list = []

    def recv(self, timeout_s: float):
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def send(self, msg, timeout_s: float) -> None:
        self.sent.append(msg)


def _node(engine) -> types.SimpleNamespace:
    stats = types.SimpleNamespace(tokens_sent=0)
    return types.SimpleNamespace(node_id="n1", engine=engine, policy_version=0, in_flight={}, stats=stats)


def _until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_relayto_reaches_the_nodes_relay_and_its_layouts_go_to_the_learner_as_relayed():
    client, engine = FakeControlClient(), types.SimpleNamespace(stager=Stager("cpu"), clock=None)
    control = ControlLoop(client, _node(engine), None, types.SimpleNamespace(moved={}), sink=None)
    assert engine.stager.relay is control.relay  # its receiver hands each version to the relay
    control.start()
    try:
        client.inbox.put(RelayTo(children=["c1", "c2"], versions=[0, 3]))
        assert _until(lambda: sorted(control.relay.children()) == ["c1", "c2"])
        ready = WeightsReady(version=4, store_host="127.0.0.1", store_port=1, group_prefix="p/", world_size=2,
                             timeout_s=1.0, buckets=[])  # fmt: skip
        control.relay.announce("c2", ready)  # what the relay's send to c2 hands its deliverer
        assert _until(lambda: any(isinstance(m, Relayed) for m in client.sent))
        relayed = next(m for m in client.sent if isinstance(m, Relayed))
        assert (relayed.node_id, relayed.child, relayed.ready) == ("n1", "c2", ready)
    finally:
        control.stopping.set()
        control.join(5)
    assert control.relay.children() == []  # the node stopped: it serves no child any more


def test_an_engine_whose_receiver_is_elsewhere_gets_no_relay():
    engine = types.SimpleNamespace(clock=None)  # vLLM's: it receives in its worker processes
    control = ControlLoop(FakeControlClient(), _node(engine), None, types.SimpleNamespace(moved={}), sink=None)
    assert control.relay is None
