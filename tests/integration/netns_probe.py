"""The probe of issue 21, run from a host of its own against a learner with CURVE on (the multi-host test).

    python netns_probe.py CONTROL_ADDR TRAJECTORY_ADDR KEYS_OF_ANOTHER_NODE VICTIM

- stranger: a client without CURVE, one with a key of its own, and one that holds a wrong server key
  try to register and to push a trajectory: none gets through;
- spoof: a peer with another node's (allowed) key sends a Goodbye and a Heartbeat for the victim, and
  tries to register under the victim's id;
- forge: the same peer pushes a trajectory in the victim's name with a huge sequence number (the frame
  that froze training at step 7 in the probe of main).
Prints one JSON line: what each case got back.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time

import zmq

from streamrl.engine import auth
from streamrl.engine.control import ControlClient
from streamrl.engine.messages import Goodbye, Heartbeat, Register, Stop, Trajectory, Welcome
from streamrl.engine.transport import TrajectorySender, TransportError


def _traj(sample_id: str) -> Trajectory:
    return Trajectory(sample_id=sample_id, group_id="probe", node_id="", seq=0, prompt_ids=[1, 2],
                      completion_ids=[3], behavior_logprobs=[-0.5], reward=1.0, policy_version=0)  # fmt: skip


def _register(addr: str, node_id: str, keys, timeout_s: float) -> str:
    with ControlClient(addr, f"probe-{node_id}-{time.monotonic_ns()}", timeout_s=timeout_s, keys=keys) as client:
        try:
            reply = client.request(Register(node_id=node_id, host="probe"), expect=(Welcome, Stop))
        except TransportError:
            return "no reply"
    return f"Stop: {reply.reason}" if isinstance(reply, Stop) else "Welcome"


def _push(addr: str, node_id: str, keys, seq: int, timeout_s: float, secret: bytes = b"") -> str:
    sender = TrajectorySender(addr, node_id, send_timeout_s=timeout_s, keys=keys, secret=secret, flush_timeout_s=1)
    with sender:
        sender.seq = seq
        try:
            sender.send(_traj(f"probe-{node_id}-{seq}"))
        except TransportError:
            return "not accepted"
    return "sent"


def main(control: str, trajectories: str, other_keys_dir: str, victim: str) -> dict[str, str]:
    other = auth.node_keys(other_keys_dir)
    own_public, own_secret = zmq.curve_keypair()
    stranger = auth.NodeKeys(other.server_public, own_public, own_secret)
    # a CURVE client with the wrong server key: its HELLO reaches the gate and cannot be opened there, a
    # handshake failure the gate always sees (a client without CURVE may hang up before the gate reads it)
    wrong_server = auth.NodeKeys(zmq.curve_keypair()[0], own_public, own_secret)
    with ControlClient(control, "probe-spoofer", timeout_s=30, keys=other) as client:
        client.send(Goodbye(node_id=victim, reason="spoofed"))  # cut the victim off from weights (probe of main)
        client.send(Heartbeat(node_id=victim, policy_version=10**6))
        time.sleep(0.5)  # let them leave before the socket closes
    cases = {
        # an allowed key gets through the gate: these wait long enough for a loaded machine's handshake
        "spoof_register_as_victim": lambda: _register(control, victim, other, timeout_s=30),
        "forge_push_as_victim": lambda: _push(trajectories, victim, other, 10**9, timeout_s=30, secret=b"guess" * 7),
        # strangers never connect: each waits out a short timeout (all at once: the run goes on meanwhile)
        "stranger_plain_register": lambda: _register(control, "intruder", None, timeout_s=2),
        "stranger_key_register": lambda: _register(control, "intruder", stranger, timeout_s=2),
        "stranger_wrong_server_register": lambda: _register(control, "intruder", wrong_server, timeout_s=2),
        "stranger_plain_push": lambda: _push(trajectories, victim, None, 10**9, timeout_s=2),
        "stranger_key_push": lambda: _push(trajectories, victim, stranger, 10**9, timeout_s=2),
    }
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        running = {name: pool.submit(case) for name, case in cases.items()}
        return {"spoof_goodbye_and_heartbeat": "sent", **{name: f.result() for name, f in running.items()}}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])), flush=True)
