"""The ledger when Redis goes away: a real embedded server killed with SIGKILL and restarted from its
append-only file, a reply lost on the wire, and a server that does not come back."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger, LedgerUnavailableError
from streamrl.engine.messages import Trajectory
from streamrl.engine.redis_server import RedisServer


def _client(url: str) -> redis.Redis:
    # The client's own retries are off: what is measured is the ledger's (ledger.retry_s).
    return redis.Redis.from_url(url, decode_responses=True, retry=Retry(NoBackoff(), 0), socket_timeout=5)


def _trajectory(sample_id: str, version: int) -> Trajectory:
    return Trajectory(
        sample_id=sample_id,
        group_id=sample_id.split(":")[0],
        node_id="n0",
        seq=0,
        prompt_ids=[1],
        completion_ids=[2],
        behavior_logprobs=[-1.0],
        reward=1.0,
        policy_version=version,
    )


def _kill(server: RedisServer) -> None:
    os.kill(server.pid, signal.SIGKILL)
    server.process.wait(timeout=10)


class _Steps(threading.Thread):
    """A node and a learner in one loop: credit -> generate -> receive -> train, until stopped."""

    def __init__(self, ledger: Ledger):
        super().__init__(daemon=True)
        self.ledger, self.stop, self.errors = ledger, threading.Event(), []
        self.groups = self.trained = self.version = 0
        self.longest_step_s = 0.0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                start = time.monotonic()
                self.ledger.heartbeat("n0")
                ids = self.ledger.take_credit("n0", f"g{self.groups}", 2)
                self.groups += 1
                batch = [_trajectory(i, self.version) for i in ids]
                self.ledger.mark_generated(batch)
                fresh = self.ledger.receive(batch, self.version).fresh
                self.trained += sum(self.ledger.commit_step([t.sample_id for t in fresh], self.version + 1, 0))
                self.version += 1
                self.longest_step_s = max(self.longest_step_s, time.monotonic() - start)
        except Exception as e:  # the test reads it
            self.errors.append(e)


def test_redis_killed_mid_calls_and_back_within_the_bound_loses_nothing(tmp_path, caplog):
    server = RedisServer(tmp_path / "redis")
    try:
        ledger = Ledger(_client(server.start()), "r", LedgerConfig(retry_s=20.0, max_staleness=1))
        ledger.init_run(groups_per_step=1)
        steps = _Steps(ledger)
        with caplog.at_level(logging.WARNING, logger="streamrl.engine.ledger"):
            steps.start()
            time.sleep(0.5)
            groups_before = steps.groups
            _kill(server)
            down = time.monotonic()
            time.sleep(1.5)
            server.start()  # same port, same folder: the ledger is read back from the append-only file
            down = time.monotonic() - down
            deadline = time.monotonic() + 15  # retries come every 0.5 s at most
            while steps.groups < groups_before + 10 and time.monotonic() < deadline and not steps.errors:
                time.sleep(0.05)
            steps.stop.set()
            steps.join(timeout=30)
        assert not steps.is_alive() and not steps.errors, steps.errors
        assert groups_before > 10 and steps.groups >= groups_before + 10  # calls ran before and after the outage
        assert "unreachable" in caplog.text and "answers again" in caplog.text
        counts = ledger.counts()
        assert counts.total == 2 * steps.groups and counts.trained == steps.trained == 2 * steps.groups
        assert counts.in_flight == 0 and counts.dropped == 0 and ledger.check(deep=True) == []
        assert ledger.current_version() == steps.version
        print(
            f"{steps.groups} steps, {counts.trained} samples trained; Redis down {down:.1f} s, "
            f"longest step {steps.longest_step_s:.1f} s"
        )
    finally:
        server.stop()


class _ReplyDropper:
    """A TCP proxy to Redis that, when armed, forwards a request but drops the connection instead of its reply."""

    def __init__(self, port: int):
        self.port, self.armed, self.dropped = port, threading.Event(), 0
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listen.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listen.accept()
            upstream = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies and self.armed.is_set():
                    self.armed.clear()
                    self.dropped += 1
                    break  # the request was executed; its reply never reaches the client
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # shutdown first: the other pump thread is blocked reading the same socket
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_a_write_whose_reply_was_lost_answers_its_retry_as_the_first_time(tmp_path):
    with RedisServer(tmp_path / "redis", password="") as server:  # the proxy's URL carries no password
        proxy = _ReplyDropper(server.port)
        ledger = Ledger(_client(proxy.url), "r", LedgerConfig(retry_s=10.0))
        ledger.init_run(groups_per_step=1)
        ledger.heartbeat("n0")
        a, b = ledger.take_credit("n0", "g0", 2)
        ledger.mark_generated([_trajectory(a, 0), _trajectory(b, 0)])
        proxy.armed.set()
        # Moved on the first try, whose reply was dropped; the retry must not call them duplicates.
        assert ledger.mark_received([a, b]) == [True, True]
        assert proxy.dropped == 1
        proxy.armed.set()
        assert ledger.take_credit("n0", "g1", 1) == ["g1:0"]
        assert ledger.mark_received([a]) == [False]  # a real second delivery is still refused
        counts = ledger.counts()
        assert (counts.total, counts.received, counts.admitted, ledger.groups_in_flight()) == (3, 2, 1, 2)


def test_redis_gone_past_the_bound_is_a_clear_error_naming_the_server(tmp_path):
    server = RedisServer(tmp_path / "redis", password="s3cret-pw")
    try:
        ledger = Ledger(_client(server.start()), "r", LedgerConfig(retry_s=1.5))
        ledger.init_run(groups_per_step=1)
        _kill(server)
        start = time.monotonic()
        with pytest.raises(LedgerUnavailableError) as failure:
            ledger.take_credit("n0", "g0", 1)
        elapsed = time.monotonic() - start
    finally:
        server.stop()
    message = str(failure.value)
    assert f"redis://:***@127.0.0.1:{server.port}/0" in message and "s3cret-pw" not in message
    assert "did not answer for 1." in message and "ledger.retry_s = 1.5" in message
    assert 1.5 <= elapsed < 3.0
