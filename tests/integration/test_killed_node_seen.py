"""A killed node is known to the learner within a beat; a frozen one never taken for gone. Real processes: each
node is a process that registers over the learner's CURVE-gated control socket (a real `NodeRegistry`) and beats
every 0.5 s like a rollout node; one is killed with SIGKILL, one frozen with SIGSTOP (alive, reading nothing,
its TCP connection open) past the probes' queue limit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from streamrl.engine import auth
from streamrl.engine.control import ControlServer
from streamrl.engine.messages import Welcome
from streamrl.learner.nodes import NodeRegistry
from streamrl.learner.reachability import PROBE_AFTER_S, PROBE_EVERY_S

# A node as the learner sees it on the control channel: it registers, then beats every 0.5 s until killed (or,
# given a last argument, for 1 s, then says goodbye and exits, as a stopped node does).
NODE = """
import sys, time
from streamrl.engine import auth
from streamrl.engine.control import ControlClient
from streamrl.engine.messages import Goodbye, Heartbeat, Register, Welcome
addr, node_id, keys = sys.argv[1:4]
client = ControlClient(addr, node_id, timeout_s=30, keys=auth.node_keys(keys))
client.request(Register(node_id=node_id, host="here"), expect=Welcome)
started = time.monotonic()
while len(sys.argv) == 4 or time.monotonic() - started < 1.0:
    client.send(Heartbeat(node_id=node_id, policy_version=0), timeout_s=1.0)
    time.sleep(0.5)
client.send(Goodbye(node_id=node_id, reason="stopped"))
client.close()
"""


def _welcome(node_id: str) -> Welcome:
    return Welcome(node_id=node_id, trajectory_addr="", redis_url="", run_name="r", policy_version=0)


@pytest.fixture
def registry(tmp_path):
    keys = auth.make_keys(tmp_path / "keys")
    gate = auth.CurveGate(auth.server_keys(keys))
    registry = NodeRegistry(ControlServer(gate=gate), _welcome)
    registry.start()
    nodes: list[subprocess.Popen] = []

    def node(node_id: str, *leaves: str) -> subprocess.Popen:
        nodes.append(subprocess.Popen([sys.executable, "-c", NODE, registry.addr, node_id, str(keys), *leaves]))
        return nodes[-1]

    yield registry, node
    for process in nodes:
        process.kill()  # a frozen one too: SIGKILL needs no SIGCONT
        process.wait()
    registry.close()
    gate.close()


def _wait(done, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_killed_node_is_unreachable_within_a_beat_and_a_frozen_one_never(registry):
    registry, node = registry
    reach = registry.reachability
    killed, frozen, _, leaving = node("killed"), node("frozen"), node("alive"), node("leaving", "goodbye")
    _wait(lambda: registry.count == 4, "four nodes registered")
    time.sleep(1.0)  # every node beating
    os.kill(frozen.pid, signal.SIGSTOP)
    os.kill(killed.pid, signal.SIGKILL)
    killed_at = time.time()
    _wait(lambda: "killed" in reach.unreachable_s(), "the killed node found unreachable", 10.0)
    known_s = time.time() - killed_at
    time.sleep(4.0)  # the frozen node is probed every PROBE_EVERY_S meanwhile; its probes queue up unread
    assert registry.silent_s("frozen") > PROBE_AFTER_S + 3.0  # positive control: it was silent, so probed
    # neither the frozen one nor the live one, nor the one that said goodbye and exited (not a loss)
    assert leaving.wait(timeout=30) == 0 and set(reach.unreachable_s()) == {"killed"}
    assert registry.silent_s("alive") < 1.0
    # a beat missed, then a probe; 1 s of slack for a loaded machine (the old way: 2 s of silence at least)
    assert known_s < PROBE_AFTER_S + PROBE_EVERY_S + 1.0, known_s
    os.kill(frozen.pid, signal.SIGCONT)
    _wait(lambda: registry.silent_s("frozen") < 1.0, "the frozen node beating again")
    assert set(reach.unreachable_s()) == {"killed"}


def test_a_beat_read_after_the_kill_does_not_make_the_killed_node_reachable_and_its_loss_ends_it(registry):
    """The beats a node sent just before its kill wait in the learner's socket; read after its connection was found
    closed, they once cleared it (seen at the defaults under load: a kill acted on a probe later, 0.6 s). A node
    the run lost (reaped: what it held resolved) leaves `unreachable`, so the learner stops asking the ledger who
    holds each group it waits for."""
    registry, node = registry
    reach = registry.reachability
    killed = node("killed")
    _wait(lambda: registry.count == 1, "the node registered")
    registry.stopping.set()  # the control thread stops reading: what the node sends now waits in the socket
    registry.join(timeout=5.0)
    time.sleep(2 * PROBE_AFTER_S)  # two beats or more, unread
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    _wait(lambda: reach.check(registry.nodes) or "killed" in reach.unreachable_s(), "found closed", 10.0)
    beats = 0
    while (got := registry.server.recv(0.5)) is not None:
        registry._handle(*got)  # as the control thread would, had it been slow
        beats += 1
    assert beats >= 1  # positive control: beats sent before the kill were read after it
    assert registry.silent_s("killed") < 2 * PROBE_AFTER_S and "killed" in reach.unreachable_s()
    registry.lost("killed", "lost: no heartbeat in the ledger")  # the reaper's word
    registry._flush_outbox()  # its Stop cannot be sent: then it is forgotten
    assert registry.count == 0 and reach.unreachable_s() == {} and reach._probed == {}


def test_a_killed_node_evicted_before_the_reaper_stays_unreachable_until_its_loss(registry):
    """A push to a killed node fails at once, so the publisher evicts it before the ledger reaps it: its groups are
    not resolved yet, so it must stay unreachable (the learner gives them up within GONE_S) until the reaper's
    `lost`. Once, forgetting the evicted node cleared its mark: its groups then waited for their deadline."""
    registry, node = registry
    reach = registry.reachability
    killed = node("killed")
    _wait(lambda: registry.count == 1, "the node registered")
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    _wait(lambda: "killed" in reach.unreachable_s(), "the killed node found unreachable", 10.0)
    registry.evict("killed", "weights not delivered")
    _wait(lambda: registry.count == 0, "the evicted node forgotten", 10.0)
    time.sleep(0.2)
    assert "killed" in reach.unreachable_s()  # forgotten, its groups still given up as a closed connection's
    registry.lost("killed", "lost: no heartbeat in the ledger")  # the reaper resolved what it held
    assert reach.unreachable_s() == {} and reach._probed == {}


@pytest.mark.parametrize("gated", [True, False], ids=["curve", "plain"])
def test_a_closed_connection_is_seen_at_once_not_after_a_missed_beat(tmp_path, gated):
    """The socket's monitor says a connection closed; the registry then asks every node, so a killed node is
    known while its last beat is still fresh (each check below sees every node heard just now, so a missed beat
    never triggers the probe). Without the monitor's word (the negative control) it is not found that way."""
    keys = auth.make_keys(tmp_path / "keys")
    gate = auth.CurveGate(auth.server_keys(keys)) if gated else None
    registry = NodeRegistry(ControlServer(gate=gate), _welcome)
    registry.start()
    reach = registry.reachability
    script = NODE if gated else NODE.replace("keys=auth.node_keys(keys)", "keys=None")
    nodes = [subprocess.Popen([sys.executable, "-c", script, registry.addr, n, str(keys)]) for n in ("killed", "alive")]
    try:
        _wait(lambda: registry.count == 2, "two nodes registered")
        registry.stopping.set()  # the checks below are the test's
        registry.join(timeout=5.0)
        registry.server.disconnected()  # nothing closed yet: what registration may have left is cleared

        def check(monitor: bool) -> None:
            for info in registry.nodes.values():
                info.last_seen = time.time()  # heard just now: no beat missed
            if not monitor:
                registry.server.disconnected = lambda: False
            reach.check(registry.nodes)

        nodes[0].kill()
        nodes[0].wait()
        time.sleep(0.5)  # the close reached the learner's socket
        check(monitor=False)
        assert reach.unreachable_s() == {}  # negative control: no missed beat, no monitor, not found
        del registry.server.disconnected
        _wait(lambda: check(monitor=True) or "killed" in reach.unreachable_s(), "found by the sweep", 0.2)
        assert set(reach.unreachable_s()) == {"killed"}
    finally:
        for process in nodes:
            process.kill()
            process.wait()
        registry.close()
        if gate is not None:
            gate.close()
