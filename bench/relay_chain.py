"""A version down a chain of relaying nodes (engine/weights/relay.py): when does the node at depth d have it?

    python -m streamrl.bench.relay_chain [--mb 256] [--bucket-mb 16] [--depth 4] [--repeats 3]

One process, real gloo groups over loopback, as the relay tree runs them (learner/relay_tree.py): the learner's
`WeightSender` to node 1 (a `Stager` with a `Relay`), node 1's relay to node 2, ..., node `depth` receiving as
from the learner. Each node's receive runs in a thread of its own, and its layout reaches its child directly (the
learner's hand-over is a control message, not timed here). Times are from the learner's send to each node's
receive done. The baseline, in the same run: the learner's own transfer to node 1 (`direct_s`); store-and-forward
(a node forwards once it has the whole version) would give `d x direct_s` at depth d, cut-through (each bucket
forwarded as it lands) about `direct_s + (d - 1) x direct_s / buckets` where the cores keep up. On one machine
every hop shares the same cores, so the hops' copies compete: `vs_store_and_forward` = time at depth d /
(d x direct_s) bounds what a network of hosts would show from above.

Prints one JSON line per depth (`figure: relay_chain`), the median over `--repeats` versions.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time

import torch

from streamrl.engine.weights import WeightSender, pack, plan_buckets, push
from streamrl.engine.weights.relay import Relay
from streamrl.engine.weights.staging import Stager

CPU = torch.device("cpu")


class _Node(threading.Thread):
    """One node of the chain: receives every layout it is given; relays to the next node unless it is the last."""

    def __init__(self, name: str, relays: bool, done: queue.Queue):
        super().__init__(name=name, daemon=True)
        self.layouts: queue.Queue = queue.Queue()
        self.stager, self.done = Stager(CPU), done
        self.child: _Node | None = None
        if relays:
            self.stager.relay = Relay(name, lambda child, ready: self.child.layouts.put(ready))

    def run(self) -> None:
        while True:
            ready = self.layouts.get()
            if ready is None:
                return
            self.stager.receive(ready)
            self.done.put((self.name, ready.version, time.perf_counter()))
            self.stager.release()


def chain_times(args) -> tuple[dict[int, list[float]], int]:
    """Seconds from each version's send to each depth's receive done, by depth; and the version's buckets."""
    done: queue.Queue = queue.Queue()
    nodes = [_Node(f"n{d}", d < args.depth, done) for d in range(1, args.depth + 1)]
    for parent, child in zip(nodes, nodes[1:]):
        parent.child = child
        parent.stager.relay.assign([child.name], [0])
    for node in nodes:
        node.start()
    sender = WeightSender("n1", backend="gloo", timeout_s=60.0)
    numel = args.mb * 2**20 // 4 // 8
    weights = {f"w{i}": torch.randn(numel) for i in range(8)}
    packed = pack(plan_buckets(weights, args.bucket_mb * 2**20), weights, "cpu")
    times: dict[int, list[float]] = {d: [] for d in range(1, args.depth + 1)}
    try:
        for version in range(1, args.repeats + 2):  # the first builds every group: not timed
            start = time.perf_counter()
            push(sender, version, packed, nodes[0].layouts.put)
            got = {}
            while len(got) < len(nodes):
                name, v, at = done.get(timeout=120)
                if v == version:
                    got[int(name[1:])] = at - start
            if version > 1:
                for depth, seconds in got.items():
                    times[depth].append(seconds)
    finally:
        for node in nodes:
            node.layouts.put(None)
            if node.stager.relay is not None:
                node.stager.relay.close()
    return times, len(packed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="the version's size, MiB (fp32)")
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times, buckets = chain_times(args)
    direct = statistics.median(times[1])
    for depth, seconds in times.items():
        at = statistics.median(seconds)
        print(json.dumps({"figure": "relay_chain", "depth": depth, "mb": args.mb, "buckets": buckets,
                          "direct_s": round(direct, 3), "at_depth_s": round(at, 3),
                          "vs_store_and_forward": round(at / (depth * direct), 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
