"""`streamrl status`: the table of a run's books, exit 1 when they do not balance."""

import io
import re
import time

from rich.console import Console

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import Trajectory
from streamrl.engine.redis_server import connect, free_port
from streamrl.ops.status import status_command


def _run_status(run, url, deep=False):
    out = io.StringIO()
    code = status_command(run, url, deep=deep, console=Console(file=out, width=120))
    return code, out.getvalue()


def _small_run(url, run) -> Ledger:
    ledger = Ledger(connect(url), run, LedgerConfig(max_staleness=1))
    ledger.init_run(groups_per_step=2)
    ledger.announce_learner("inc-1", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    ledger.learner_heartbeat("inc-1")  # a learner is running it
    ledger.heartbeat("node-a")
    ids = ledger.take_credit("node-a", "g0", 4)
    batch = [
        Trajectory(
            sample_id=s,
            group_id="g0",
            node_id="node-a",
            seq=i,
            prompt_ids=[1],
            completion_ids=[2],
            behavior_logprobs=[-1.0],
            reward=1.0,
            policy_version=0,
        )
        for i, s in enumerate(ids)
    ]
    ledger.mark_generated(batch[:3])
    ledger.publish_version(1, step=1)
    ledger.receive(batch[:2], current_version=1)
    ledger.mark_trained(ids[:1])
    ledger.drop(ids[2:3], "reward_error")
    return ledger


def test_status_prints_the_books_and_exits_0(redis_url, ledger_run):
    _small_run(redis_url, ledger_run)
    code, text = _run_status(ledger_run, redis_url, deep=True)
    assert code == 0, text
    # 4 samples: 1 trained, 1 dropped, 2 in flight (1 admitted, 1 received)
    assert "books balance: 4 = 1 trained + 1 dropped + 2 in flight" in text
    assert "dropped:reward_error" in text and "node-a" in text
    assert "1 / 4" in text  # one group of capacity (1 + 1) * 2
    assert "1:1" in text  # trained at version 1 from version 0


def test_status_exits_1_when_a_sample_vanished(redis_url, ledger_run):
    ledger = _small_run(redis_url, ledger_run)
    ledger.client.hincrby(ledger.prefix + "counts", "received", -1)  # a sample lost from the books
    code, text = _run_status(ledger_run, redis_url)
    assert code == 1
    assert "books do not balance: total 4 != trained 1 + dropped 1 + in flight 1" in text
    ledger.client.hincrby(ledger.prefix + "counts", "received", 1)
    ledger.client.hset(ledger.prefix + "s:g0:3", "state", "trained")  # a record the counters disagree with
    code, text = _run_status(ledger_run, redis_url, deep=True)
    assert code == 1 and "sample records by state" in text
    ledger.client.hset(ledger.prefix + "s:g0:3", "state", "admitted")
    ledger.drop(["g0:1", "g0:3"], "preempted")


def test_a_run_whose_learner_stopped_beating_without_an_ending_is_not_running(redis_url, ledger_run):
    ledger = _small_run(redis_url, ledger_run)
    code, text = _run_status(ledger_run, redis_url)
    assert code == 0 and _row(text, "run") == "running"  # it beats
    ledger.client.delete(ledger.prefix + "learner:alive")  # its heartbeat ran out: killed, or its host lost
    code, text = _run_status(ledger_run, redis_url)
    beat = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(ledger.learner()["beat"])))
    assert code == 0 and _row(text, "run").startswith(f"stopped without an ending: no learner heartbeat since {beat}")


def _row(text: str, name: str) -> str:
    """The value of the table's row `name`."""
    return re.search(rf"│ {name} +│ +(.*?) │", text).group(1)


def test_status_of_an_unknown_run_or_server(redis_url):
    code, text = _run_status("never-ran", redis_url)
    assert code == 1 and "no run 'never-ran'" in text
    code, text = _run_status("x", f"redis://127.0.0.1:{free_port()}/0")
    assert code == 2 and "cannot reach Redis at redis://127.0.0.1:" in text


def test_a_finished_run_with_unresolved_samples_exits_1_naming_their_holders(redis_url, ledger_run):
    ledger = _small_run(redis_url, ledger_run)  # node-a holds g0:3 (admitted); g0:1 received, never trained
    ledger.client.delete(ledger.prefix + "alive:node-a")  # node-a is gone (its heartbeat ran out)
    code, text = _run_status(ledger_run, redis_url)
    assert code == 0 and _row(text, "run") == "running"  # a run going on: these samples may still resolve
    assert "held by gone nodes" in text and "1 (node-a 1)" in text and "held by live nodes" in text
    ledger.finish_run()
    code, text = _run_status(ledger_run, redis_url)
    assert code == 1 and "finished" in text
    assert (
        "the run has finished with 2 samples neither trained nor dropped: 1 held by gone nodes (node-a 1), "
        "1 received by the learner, never trained" in " ".join(text.split())
    )
    assert ledger.resolve_node("node-a") == 1 and ledger.drop_received() == 1
    code, text = _run_status(ledger_run, redis_url)
    assert code == 0 and "books balance: 4 = 1 trained + 3 dropped + 0 in flight" in text
