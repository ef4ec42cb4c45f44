"""Several processes racing for credits never hold more groups than the capacity."""

import subprocess
import sys

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect

# Each worker is a rollout node: take a credit, count itself into `holding` (a plain counter the
# ledger never touches), then leave `holding` before resolving the group. If the ledger ever
# granted more credits than the capacity, some worker would see holding > capacity.
WORKER = r"""
import random, sys
from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger, sample_ids
from streamrl.engine.redis_server import connect
url, run, node, rounds, capacity = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
client = connect(url)
ledger = Ledger(client, run, LedgerConfig(heartbeat_ttl_s=60))
ledger.heartbeat(node)
rng = random.Random(node)
taken = worst = 0
for i in range(rounds):
    ids = ledger.take_credit(node, f"{node}-{i}", 2)
    if ids is None:
        continue
    taken += 1
    worst = max(worst, client.incr(f"test:{run}:holding"))
    client.decr(f"test:{run}:holding")
    if rng.random() < 0.5:
        ledger.drop(ids, "preempted")
    else:
        ledger.drop(ids[:1], "overlong")
        ledger.drop(ids[1:], "stale")
print(taken, worst)
"""


def test_racing_nodes_never_exceed_capacity(redis_url, ledger_run):
    ledger = Ledger(connect(redis_url), ledger_run, LedgerConfig(max_staleness=1))
    capacity = ledger.init_run(groups_per_step=1)  # (1 + 1) * 1 = 2 groups for 4 nodes
    rounds = 150
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, redis_url, ledger_run, f"n{i}", str(rounds), str(capacity)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    taken, worst = zip(*(map(int, out.split()) for out, _ in results))
    assert max(worst) <= capacity
    counts = ledger.counts()
    assert counts.total == 2 * sum(taken) and counts.dropped == counts.total
    assert ledger.groups_in_flight() == 0
    assert sum(taken) > capacity  # credits did come back and were taken again
