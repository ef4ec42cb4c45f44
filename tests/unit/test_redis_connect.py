"""`connect` waits out a server that is loading its data (LOADING answers) instead of counting them as
failed attempts; a server that never finishes loading fails it after `LOADING_S`, naming the URL."""

import socket
import threading
import time

import pytest

from streamrl.engine import redis_server
from streamrl.engine.redis_server import RedisUnavailableError, connect


class FakeLoadingRedis:
    """Stands in for a Redis server loading a large append-only file: answers every command but the handshake
    (HELLO, which a loading Redis answers too) with LOADING for `loading_s`, then +OK (PING: +PONG). A real one
    answers LOADING only between 2 MiB slices of its file (tests/integration/test_redis_server.py loads one);
    this one answers at once, so a client's attempts are counted, not timed."""

    def __init__(self, loading_s: float):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.until = time.monotonic() + loading_s
        self.loading_answers = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                for command in data.split(b"*")[1:]:  # each command is an array
                    if b"HELLO" in command.upper():
                        conn.sendall(b"%1\r\n+proto\r\n:3\r\n" if b"3" in command else b"*2\r\n$5\r\nproto\r\n:2\r\n")
                    elif time.monotonic() < self.until:
                        self.loading_answers += 1
                        conn.sendall(b"-LOADING Redis is loading the dataset in memory\r\n")
                    else:
                        conn.sendall(b"+PONG\r\n" if b"PING" in command.upper() else b"+OK\r\n")

    def close(self) -> None:
        self.listener.close()


def test_connect_waits_for_a_server_that_is_loading_its_data():
    server = FakeLoadingRedis(loading_s=1.5)  # longer than 3 attempts' backoff (0.2 + 0.4 s)
    try:
        started = time.monotonic()
        client = connect(f"redis://127.0.0.1:{server.port}/0", retries=3, timeout_s=5.0)
        client.close()
        assert time.monotonic() - started >= 1.4 and server.loading_answers > 3  # it was answered LOADING, often
    finally:
        server.close()


def test_a_server_still_loading_after_the_bound_fails_connect_naming_it(monkeypatch):
    monkeypatch.setattr(redis_server, "LOADING_S", 0.5)
    server = FakeLoadingRedis(loading_s=60.0)
    try:
        with pytest.raises(
            RedisUnavailableError, match=rf"127.0.0.1:{server.port}.* still loading its data after 0.5 s"
        ):
            connect(f"redis://127.0.0.1:{server.port}/0", retries=3, timeout_s=5.0)
    finally:
        server.close()
