"""An `hf` rollout node in a process of its own, and the learner's side of it, for the weight-path tests.

The worker (`python hf_node_worker.py --model M --device D --fd N [--backend vllm]`) runs an `HFBackend` (or a
`VLLMBackend`, eager, whose digest is empty: its weights are in vLLM's own layout) and is driven
over an inherited socket in msgpack frames. It first says where it runs (`{"where": [host, boot_id,
device, gpu_uuid]}`, what a node's `Register` carries); then
`{"op": "weights", "ready": <WeightsReady>}` starts `update_weights` (stage while serving, swap between
batches) and answers `{"applied": <WeightsApplied>, "copy_s": ...}` once the version is live;
`{"op": "digest"}` -> `{"digest": {name: sha256 of the parameter's bytes}, "version"}`;
`{"op": "generate", "prompt", "n", "max_tokens"}` -> `{"tokens", "versions"}`; `{"op": "stop"}`.

`FakeRegistry` (imported by the tests through the `hf_nodes` fixture) is `NodeRegistry` with its control
channel (`send` / `take_applied`) over these processes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import msgspec

from streamrl.engine import messages
from streamrl.engine.messages import Stop, WeightsApplied, WeightsReady
from streamrl.engine.weights import Location
from streamrl.learner.nodes import NodeInfo, NodeRegistry

WORKER = pathlib.Path(__file__)


def digest(named) -> dict[str, str]:
    """sha256 of each tensor's bytes: equal digests are bit-exact weights."""
    import torch

    def raw(t) -> bytes:
        return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    return {name: hashlib.sha256(raw(t)).hexdigest() for name, t in named}


# ---- the node process --------------------------------------------------------------------------


def serve(model: str, device: str, fd: int, backend: str = "hf") -> None:
    import torch

    from streamrl.engine.config import ModelConfig, RolloutConfig
    from streamrl.engine.weights import here

    conn, lock = Connection(fd), threading.Lock()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    config = ModelConfig(max_model_len=512, dtype="bfloat16" if device.startswith("cuda") else "float32")
    if backend == "vllm":
        from streamrl.rollout.backends.vllm import VLLMBackend
        from streamrl.rollout.backends.vllm_support import Sizing

        gpu = Sizing(max_seqs=16, batch_tokens=2048, kv_bytes=512 << 20, share_gib=4.0)
        size = Sizing() if device == "cpu" else gpu

        async def make():  # AsyncLLM starts its output loop in the running event loop
            return VLLMBackend(model, config, RolloutConfig(enforce_eager=True), device=device, size=size)

        engine = asyncio.run_coroutine_threadsafe(make(), loop).result(timeout=600)
    else:
        from streamrl.rollout.backends.hf import HFBackend

        engine = HFBackend(model, config, RolloutConfig(), device=device, static=False)

    def reply(frame: dict) -> None:
        with lock:
            conn.send_bytes(msgspec.msgpack.encode(frame))

    async def weights(ready: WeightsReady) -> None:
        try:
            seconds = await engine.update_weights(ready)
            reply({"applied": messages.encode(WeightsApplied(node_id="", version=ready.version, seconds=seconds))})
        except Exception as e:  # reported, as the node's control loop does
            failed = WeightsApplied(node_id="", version=ready.version, seconds=0.0, error=f"{type(e).__name__}: {e}")
            reply({"applied": messages.encode(failed)})

    where = here(device)
    reply({"where": [where.host, where.boot_id, where.device, where.gpu_uuid]})
    while True:
        req = msgspec.msgpack.decode(conn.recv_bytes())
        if req["op"] == "stop":
            break
        if req["op"] == "weights":
            asyncio.run_coroutine_threadsafe(weights(messages.decode_control(req["ready"])), loop)
        elif req["op"] == "digest":
            with torch.no_grad():
                named = engine.model.state_dict().items() if backend == "hf" else []
                reply({"digest": digest(named), "version": engine.policy_version})
        elif req["op"] == "generate":
            outs = asyncio.run_coroutine_threadsafe(engine.generate(req["prompt"], req["n"], req["max_tokens"]), loop)
            completions = outs.result(timeout=120)
            reply({"tokens": [c.token_ids for c in completions], "versions": [c.token_versions for c in completions]})
    os._exit(0)


# ---- the learner's side ------------------------------------------------------------------------


class NodeProc:
    def __init__(self, node_id: str, model: str, device: str, log: pathlib.Path, backend: str = "hf"):
        ours, theirs = socket.socketpair()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), "--model", model, "--device", device, "--fd", str(theirs.fileno()),
                 "--backend", backend],
                pass_fds=[theirs.fileno()], stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        theirs.close()
        self.node_id, self.log, self.conn = node_id, log, Connection(ours.detach())
        self.applied: queue.Queue[WeightsApplied] = queue.Queue()
        self.replies: queue.Queue[dict] = queue.Queue()
        self.lock = threading.Lock()
        self._where: Location | None = None  # waited for on first use: nodes started together start together

    @property
    def where(self):
        """The node's location, once it has started (its engine built)."""
        with self.lock:
            if self._where is None:
                if not self.conn.poll(300):
                    raise TimeoutError(f"node {self.node_id} did not start: {self.log.read_text()[-2000:]}")
                self._where = Location(*msgspec.msgpack.decode(self.conn.recv_bytes())["where"])
                threading.Thread(target=self._read, daemon=True).start()
            return self._where

    def _read(self) -> None:
        try:
            while True:
                frame = msgspec.msgpack.decode(self.conn.recv_bytes())
                if "applied" in frame:
                    applied = messages.decode_control(frame["applied"])
                    self.applied.put(WeightsApplied(node_id=self.node_id, version=applied.version,
                                                    seconds=applied.seconds, error=applied.error))  # fmt: skip
                else:
                    self.replies.put(frame)
        except (EOFError, OSError):
            return

    def send(self, **req) -> None:
        self.where  # noqa: B018 - started first
        with self.lock:
            self.conn.send_bytes(msgspec.msgpack.encode(req))

    def request(self, timeout_s: float = 120.0, **req) -> dict:
        self.send(**req)
        return self.replies.get(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None and self._where is None:  # never used: not waited for
            self.kill()
        elif self.proc.poll() is None:
            try:
                self.send(op="stop")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.conn.close()


class FakeRegistry(NodeRegistry):
    """Stands in for `NodeRegistry`'s control channel only, over node processes: `send` hands a
    `WeightsReady` to the node's socket, `take_applied` reads its confirmations; the membership (`attach`,
    `links`, `evict`, `forget`) is NodeRegistry's own (`evict` only notes why and when first).
    `on_ready(node_id, ready)` runs when a `WeightsReady` has gone out to a node (the tests kill a node there)."""

    def __init__(self, procs: dict[str, NodeProc], on_ready=None):
        super().__init__(server=None, welcome=None)  # no socket: the control thread is never started
        self.procs, self.on_ready = procs, on_ready
        self.stopped: list[str] = []
        self.why: dict[str, str] = {}  # node -> why it was evicted
        self.evicted_at: dict[str, float] = {}  # node -> when (time.monotonic)
        for node_id, proc in procs.items():  # registered, as their Register would
            self.nodes[node_id] = NodeInfo(node_id.encode(), proc.where.host, 0.0, 0.0, where=proc.where)

    def evict(self, node_id: str, why: str) -> None:
        self.why[node_id], self.evicted_at[node_id] = why, time.monotonic()
        super().evict(node_id, why)

    def send(self, node_id, msg, then_forget=False, resolved=True):
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            if isinstance(msg, WeightsReady):
                self.procs[node_id].send(op="weights", ready=messages.encode(msg))
                if self.on_ready is not None:
                    self.on_ready(node_id, msg)
            elif isinstance(msg, Stop):
                self.stopped.append(node_id)
            done.set_result(None)
        except OSError as e:
            done.set_exception(e)
        if then_forget:
            self.forget(node_id, resolved)
        return done

    def take_applied(self, node_id):
        try:
            return self.procs[node_id].applied.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        for node_id in list(self.nodes):
            self.forget(node_id)


def evicted_now(publisher) -> list[str]:
    """What the orchestrator does with the publisher's report: the registry evicts each node."""
    reported = publisher.poll()
    for node_id, why in reported:
        publisher.registry.evict(node_id, why)
    return [node_id for node_id, _ in reported]


def wait_for(cond, publisher, timeout_s: float) -> list[str]:
    """Poll the publisher (confirmations in, deadlines checked) until `cond()`; the nodes it evicted."""
    evicted, deadline = [], time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        evicted += evicted_now(publisher)
        time.sleep(0.01)
    return evicted + evicted_now(publisher)


def evicted_in_time(got: dict, deadline_s: float) -> bool:
    """Node b evicted within one deadline of its kill (and a poll), not one per bucket or phase: at the deadline
    when nothing told the learner sooner, or at once when its next write to the dead node broke (the kill
    can land before the learner's layout message goes out: a broken pipe in phase 'layout', seen in CI)."""
    after, why = got["evicted_after_s"], got["why"].get("b", "")
    if after < deadline_s * 0.8:
        return "failed in phase" in why and "weights.timeout_s" not in why
    return after < deadline_s + 2.0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    opts = parser.parse_args()
    serve(opts.model, opts.device, opts.fd, opts.backend)


def kill_mid_copy_scenario(start, model_path: str, device: str, deadline_s: float) -> dict:
    """Two nodes on `device` by the shared path, the real `Publisher` on the learner's side: version 1
    reaches both bit-exact; node b is killed as soon as version 2's `WeightsReady` reached it (before or
    during its copy), while the learner keeps publishing a version every 0.2 s. What happened, for the
    test to judge (`evicted_in_time`): paths, digests, holds, eviction time and why."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.engine.config import build
    from streamrl.learner.publisher import Publisher

    a, b = start("a", model_path, device), start("b", model_path, device)
    killed: dict[str, float] = {}

    def on_ready(node_id: str, ready: WeightsReady) -> None:
        if node_id == "b" and ready.version == 2:
            b.kill()
            killed["at"] = time.monotonic()

    nodes = FakeRegistry({"a": a, "b": b}, on_ready)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    cfg = build({}, ["weights.bucket_mb=0.05", f"weights.timeout_s={deadline_s}"])
    publisher = Publisher(cfg, nodes, torch.device(device))
    out: dict = {"holds": [], "evicted": []}
    try:
        publisher.add("a", a.where), publisher.add("b", b.where)
        out["paths"] = {n: s.path for n, s in publisher.states().items()}
        publisher.publish(1, model.state_dict())
        wait_for(lambda: all(s.applied == 1 for s in publisher.states().values()), publisher, 120)
        out["v1"] = [digest(model.state_dict().items()), a.request(op="digest"), b.request(op="digest")]
        version = 1
        # until b is gone, and past version 6 whatever the path: b's eviction can be at once (a broken write)
        while ("b" in publisher.states() or version < 7) and version < 200:
            version += 1
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            out["holds"].append(publisher.publish(version, model.state_dict()))
            out["evicted"] += wait_for(lambda: False, publisher, 0.2)
        out["evicted_after_s"] = nodes.evicted_at.get("b", time.monotonic()) - killed["at"]
        out["versions_meanwhile"] = version - 2
        out["stopped"], out["why"] = nodes.stopped, dict(nodes.why)
        wait_for(lambda: publisher.states()["a"].applied == version, publisher, 60)
        out["last"] = [version, digest(model.state_dict().items()), a.request(op="digest")]
        out["a_applied"] = publisher.states()["a"].applied
        out["model"], out["a"] = model, a
        return out
    finally:
        nodes.close()
