"""A vLLM node's half of its relay (rollout/backends/vllm_relay.py `WorkerRelay`), against a worker that is the real
`RelayInWorker` with a real `Stager` behind a stand-in for vLLM's `collective_rpc` (the RPC's own path is
tests/integration/test_vllm_relay.py's): the control thread's `assign` reaches the worker's relay; the layouts the
worker makes for its children reach `announce` as the learner's `WeightsReady`; the node asks its worker often only
while a layout is due, and `close` stops the worker's relay."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from streamrl.engine.messages import BucketSpec, WeightsReady
from streamrl.engine.weights.staging import Stager
from streamrl.rollout.backends import vllm_relay
from streamrl.rollout.backends.vllm_relay import RelayInWorker, WorkerRelay


class Worker(RelayInWorker):
    """The worker extension's state as `WeightReceiverExtension._staging` makes it."""

    def __init__(self) -> None:
        self._streamrl_staging = {"stager": Stager("cpu"), "staged": None, "error": "", "lock": threading.Lock()}

    def _staging(self) -> dict:
        return self._streamrl_staging


class Engine:
    """`collective_rpc` over one worker, counting the calls by method."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.calls = worker, {}

    async def collective_rpc(self, method: str, args=()):
        self.calls[method] = self.calls.get(method, 0) + 1
        return [getattr(self.worker, method)(*args)]


@pytest.fixture
def node():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    worker = Worker()
    engine, announced = Engine(worker), []
    relay = WorkerRelay(engine, "n1", lambda child, ready: announced.append((child, ready)), loop)
    yield relay, worker, engine, announced
    relay.close()
    _until(lambda: relay._poll is None or relay._poll.done())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def _ready(version: int) -> WeightsReady:
    bucket = BucketSpec(dtype="float32", numel=4, tensors=[])
    return WeightsReady(version=version, store_host="127.0.0.1", store_port=1, group_prefix="p/", world_size=2,
                        timeout_s=5.0, buckets=[bucket], backend="gloo")  # fmt: skip


def _until(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_assign_reaches_the_workers_relay_and_its_layouts_reach_the_learner(node, monkeypatch):
    relay, worker, engine, announced = node
    relay.assign(["c1", "c2"], [0, 0])
    assert _until(lambda: worker._staging().get("relay") is not None)
    in_worker = worker._staging()["relay"]
    assert _until(lambda: sorted(in_worker.children()) == ["c1", "c2"])
    assert worker._staging()["stager"].relay is in_worker  # each version the worker receives is offered to it
    in_worker.close()  # no real sends here: the layouts are what the worker's senders would announce
    in_worker.announce("c1", _ready(3))
    in_worker.announce("c2", _ready(3))
    assert _until(lambda: len(announced) == 2)
    assert sorted(child for child, _ in announced) == ["c1", "c2"] and all(r == _ready(3) for _, r in announced)


def test_the_node_asks_often_only_while_a_layout_is_due(node, monkeypatch):
    monkeypatch.setattr(vllm_relay, "ASSIGN_HOT_S", 0.0)
    relay, worker, engine, announced = node
    relay.assign(["c1"], [0])
    assert _until(lambda: engine.calls.get("relay_outbox", 0) >= 1)
    worker._staging()["relay"].close()
    start = engine.calls["relay_outbox"]
    time.sleep(0.6)
    idle = engine.calls["relay_outbox"] - start  # every SLOW_S (0.25 s)
    relay.expect(_ready(4))  # a version on its way: c1 is due its layout
    start = engine.calls["relay_outbox"]
    time.sleep(0.3)
    due = engine.calls["relay_outbox"] - start  # every FAST_S (0.02 s)
    worker._staging()["relay"].announce("c1", _ready(4))
    assert _until(lambda: len(announced) == 1)
    time.sleep(0.1)
    start = engine.calls["relay_outbox"]
    time.sleep(0.6)
    after = engine.calls["relay_outbox"] - start  # every child has it: slow again
    assert idle <= 3 and due >= 5 and after <= 3, (idle, due, after)


def test_close_stops_the_workers_relay(node):
    relay, worker, engine, _ = node
    relay.assign(["c1"], [0])
    assert _until(lambda: worker._staging().get("relay") is not None)
    relay.close()
    assert _until(lambda: engine.calls.get("relay_close", 0) == 1)
    assert worker._staging()["relay"].children() == []
