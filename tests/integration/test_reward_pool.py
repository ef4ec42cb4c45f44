"""The reward worker pool against real processes: deadlines, crashes, errors, user files, the ledger."""

from __future__ import annotations

import logging
import pathlib
import runpy
import textwrap
import time

import pytest

from streamrl.engine.config import RewardConfig
from streamrl.rewards import build_scorer

USER_REWARDS = textwrap.dedent("""
    import asyncio
    import os
    import time

    def sleeper(prompts, completions, completion_ids, **columns):
        if any("hang" in c for c in completions):
            time.sleep(3600)
        return [1.0] * len(completions)

    def raiser(prompts, completions, completion_ids, **columns):
        if any("boom" in c for c in completions):
            raise RuntimeError("boom in a user reward")
        return [float(len(c)) for c in completions]

    def crasher(prompts, completions, completion_ids, **columns):
        if any("crash" in c for c in completions):
            os._exit(3)
        return [2.0] * len(completions)

    async def async_match(prompts, completions, completion_ids, answer, level, **columns):
        await asyncio.sleep(0)
        return [float(c == a) * lv for c, a, lv in zip(completions, answer, level)]

    def wrong_length(prompts, completions, completion_ids, **columns):
        return [1.0]
""")


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("user_rewards") / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def pool_scorer(user_file: str, fn: str, **fields):
    fields.setdefault("workers", 2)
    return build_scorer(RewardConfig(functions=[f"{user_file}:{fn}"], **fields))


def score(scorer, completions: list[str], **row):
    n = len(completions)
    return scorer.score(["p"] * n, completions, [[1, 2]] * n, [dict(row) for _ in range(n)])


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_hung_reward_returns_none_by_its_deadline_and_the_pool_keeps_serving(user_file, start_method):
    with pool_scorer(user_file, "sleeper", timeout_s=1.0, start_method=start_method) as scorer:
        score(scorer, ["warm", "up"])  # both workers booted, so the deadline measures the call alone
        start = time.monotonic()
        rewards = score(scorer, ["hang", "fine"])  # 2 workers: one sample each
        elapsed = time.monotonic() - start
        assert rewards == [None, 1.0]
        assert elapsed < 30, "the hung call was not cut at its 1 s deadline"  # it sleeps for an hour
        assert scorer.stats.timeouts == 1 and scorer.stats.restarts == 1 and scorer.stats.none == 1
        assert score(scorer, ["a", "b", "c"]) == [1.0, 1.0, 1.0]  # the replacement worker serves
        assert score(scorer, ["hang"]) == [None]
        assert scorer.stats.timeouts == 2 and scorer.stats.restarts == 2
        assert score(scorer, ["after"]) == [1.0]


def test_a_raising_reward_costs_only_its_sample_and_logs_one_traceback(user_file, caplog):
    with pool_scorer(user_file, "raiser", workers=1) as scorer, caplog.at_level(logging.WARNING, "streamrl.rewards"):
        assert score(scorer, ["ab", "boom", "abc"]) == [2.0, None, 3.0]
        assert score(scorer, ["boom", "x"]) == [None, 1.0]
        assert scorer.stats.errors == 2 and scorer.stats.none == 2 and scorer.stats.timeouts == 0
        assert scorer.stats.by_function[f"{user_file}:raiser"]["errors"] == 2
    logged = [r for r in caplog.records if "boom in a user reward" in r.getMessage()]
    assert len(logged) == 1, "the first traceback is logged once, later failures only counted"
    # the worker's batch fell back to one sample a call, and the scorer said so (the line the live view shows)
    assert logged[0].levelname == "WARNING" and "each sample was scored alone, 1 failed" in logged[0].getMessage()


def test_a_crashing_worker_gives_none_and_is_replaced(user_file):
    with pool_scorer(user_file, "crasher", workers=1) as scorer:
        assert score(scorer, ["crash", "x"]) == [None, None]  # one worker: both samples were in the call
        assert scorer.stats.errors == 2 and scorer.stats.restarts == 1
        assert score(scorer, ["x"]) == [2.0]


def test_a_worker_killed_while_idle_is_replaced_before_the_next_call(user_file):
    import os
    import signal

    with pool_scorer(user_file, "raiser", workers=1) as scorer:
        assert score(scorer, ["ab"]) == [2.0]
        victim = scorer.pool.workers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)
        assert score(scorer, ["abc"]) == [3.0]
        assert scorer.stats.restarts == 1 and scorer.stats.errors == 0


def test_a_user_async_reward_from_a_file_gets_columns_as_lists(user_file):
    with pool_scorer(user_file, "async_match", workers=1) as scorer:
        rewards = scorer.score(
            ["p", "p"], ["7", "8"], [[1], [2]], [{"answer": "7", "level": 3}, {"answer": "7", "level": 5}]
        )
    assert rewards == [3.0, 0.0]  # "7" == "7" -> 1 * level 3; "8" != "7" -> 0


TRL_REWARDS = pathlib.Path(__file__).parents[1] / "data" / "trl_rewards.py"


@pytest.mark.parametrize("workers", [1, 2])
def test_rewards_written_as_trl_documents_them_run_unchanged_in_the_pool(workers):
    trl = runpy.run_path(str(TRL_REWARDS))  # the expected values, worked out in the file's comments
    specs = [f"{TRL_REWARDS}:{name}" for name in trl["SPECS"]]
    with build_scorer(RewardConfig(functions=specs, weights=trl["WEIGHTS"], workers=workers)) as scorer:
        assert scorer.pool is not None
        n = len(trl["COMPLETIONS"])
        assert scorer.score(["q"] * n, trl["COMPLETIONS"], trl["COMPLETION_IDS"], trl["ROWS"]) == trl["EXPECTED"]
        assert scorer.stats.errors == 0 and scorer.stats.timeouts == 0


def test_a_reward_of_the_wrong_length_is_an_error_not_a_score(user_file):
    with pool_scorer(user_file, "wrong_length", workers=1) as scorer:
        # never retried one sample a call, where a batch of one gets its one value: a batch mean is no score
        assert score(scorer, ["a", "b"]) == [None, None]
        assert scorer.stats.errors == 2
        assert "returned 1 values for 2 completions" in scorer.first_error


def test_builtins_and_math_run_in_the_pool_combined_with_weights(user_file):
    cfg = RewardConfig(functions=["demo", "math", f"{user_file}:raiser"], weights=[1.0, 2.0, 0.5], workers=2)
    with build_scorer(cfg) as scorer:
        rewards = scorer.score(
            ["p", "p", "p"], ["aa", r"\boxed{0.5}", "boom"], [[1], [2], [3]], [{"answer": "1/2"}] * 3
        )
    # demo compares each character with the whole answer "1/2": always 0 here.
    # "aa": math 0; raiser len 2 -> 0.5 * 2 = 1.0
    # "\boxed{0.5}": math 1 -> 2 * 1 = 2.0; raiser len 11 -> 0.5 * 11 = 5.5; total 7.5
    # "boom": raiser raises -> None
    assert rewards == [1.0, 7.5, None]


def test_a_none_reward_is_dropped_as_reward_error_in_the_ledger(user_file, redis_url, ledger_run):
    from streamrl.engine.ledger import Ledger
    from streamrl.engine.messages import Trajectory
    from streamrl.engine.redis_server import connect

    ledger = Ledger(connect(redis_url), ledger_run)
    ledger.init_run(groups_per_step=1)
    ledger.heartbeat("node0")
    ids = ledger.take_credit("node0", "g0", 2)
    with pool_scorer(user_file, "raiser", workers=1) as scorer:
        rewards = score(scorer, ["ok", "boom"])
    samples = [
        Trajectory(
            sample_id=i,
            group_id="g0",
            node_id="node0",
            seq=k,
            prompt_ids=[1],
            completion_ids=[2],
            behavior_logprobs=[-0.5],
            reward=r,
            policy_version=0,
        )
        for k, (i, r) in enumerate(zip(ids, rewards))
    ]
    ledger.mark_generated(samples)
    received = ledger.receive(samples, current_version=0)
    assert [s.sample_id for s in received.fresh] == [ids[0]]
    assert received.reward_errors == [ids[1]]
    assert ledger.counts().dropped_by_reason == {"reward_error": 1}
    ledger.mark_trained([ids[0]])


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys
    from streamrl.engine.config import RewardConfig
    from streamrl.rewards import build_scorer

    if __name__ == "__main__":
        scorer = build_scorer(RewardConfig(functions=[sys.argv[1] + ":sleeper"], workers=1, timeout_s=3600))
        print(scorer.pool.workers[0].proc.pid, flush=True)
        scorer.score(["p"], ["hang"], [[1]], [{}])
""")


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_worker_stuck_in_a_hung_reward_dies_with_its_killed_parent(user_file, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), user_file], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.5)  # let the hung call start
        assert _alive(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)
