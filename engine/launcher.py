"""`streamrl run`: a whole run on one machine — embedded Redis, one learner, N rollout nodes.

Every child is a process of its own (`python -m streamrl.learner.main`, `python -m
streamrl.rollout.service`), writing to its own log in `RUN/logs/`; the console shows only the
live view. Ctrl-C (or the learner finishing) stops every child this launcher started, by pid:
SIGTERM, a grace period, then SIGKILL. Nodes can be added (`add_node`) or stopped (`stop_node`)
while the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from streamrl.engine.config import Config, dump
from streamrl.engine.redis_server import RedisServer

STOP_GRACE_S = 45.0  # longer than a node's own grace for finishing its groups (30 s)


@dataclasses.dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: pathlib.Path
    started: float = dataclasses.field(default_factory=time.time)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"


def child_env(cfg: Config, run_dir: pathlib.Path) -> dict[str, str]:
    """In-process vLLM engines, no torch.compile on CPU, and vLLM's socket files kept in the run folder."""
    tmp = run_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if cfg.run.device != "cuda":
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
    return env


class Launcher:
    """Owns the run's processes; everything it starts, it stops."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = cfg.run.path
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.redis: RedisServer | None = None
        self.learner: Child | None = None
        self.nodes: dict[str, Child] = {}
        self.config_path = self.run_dir / "config.toml"
        self._next_node = 0

    def start(self, nodes: int, timeout_s: float = 300.0) -> None:
        if not self.cfg.ledger.url:
            self.redis = RedisServer(self.run_dir / "redis")
            self.cfg = _with(self.cfg, "ledger", url=self.redis.start())
        self.config_path.write_text(dump(self.cfg))
        self.learner = self._spawn("learner", self._learner_command())
        self.wait_for_learner(timeout_s)
        for _ in range(nodes):
            self.add_node()

    def _learner_command(self) -> list[str]:
        args = ["-m", "streamrl.learner.main", "--config", str(self.config_path)]
        if self.cfg.learner.ranks > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={self.cfg.learner.ranks}", *args[1:]]
        return [sys.executable, *args]

    def wait_for_learner(self, timeout_s: float) -> dict:
        """The learner's addresses, once it wrote them; a clear error if it died or took too long."""
        path = self.run_dir / "learner.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.learner.alive:
                raise RuntimeError(f"the learner exited with code {self.learner.process.returncode} before it "
                                   f"was up; its log {self.learner.log_path}:\n{self.learner.log_tail()}")
            if path.is_file() and path.stat().st_mtime >= self.learner.started - 1:
                return json.loads(path.read_text())
            time.sleep(0.2)
        raise RuntimeError(f"the learner was not up after {timeout_s:.0f} s; its log {self.learner.log_path}:\n"
                           f"{self.learner.log_tail()}")

    def add_node(self) -> str:
        name = f"node-{self._next_node}"
        self._next_node += 1
        command = [sys.executable, "-m", "streamrl.rollout.service", "--config", str(self.config_path),
                   "--learner", str(self.run_dir), "--node-id", name]
        self.nodes[name] = self._spawn(f"rollout-{name}", command)
        return name

    def stop_node(self, name: str, timeout_s: float = STOP_GRACE_S) -> int | None:
        child = self.nodes.pop(name)
        return _stop(child.process, timeout_s)

    def _spawn(self, name: str, command: list[str]) -> Child:
        log_path = self.run_dir / "logs" / f"{name}.out"
        with log_path.open("ab") as out:
            # Own process group: a terminal's Ctrl-C reaches the launcher, which stops children in order.
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=child_env(self.cfg, self.run_dir), start_new_session=True)
        return Child(name, process, log_path)

    @property
    def ledger_url(self) -> str | None:
        return self.cfg.ledger.url or None

    def stop_all(self, keep_redis: bool = False) -> None:
        """Nodes first (they resolve their samples while the ledger is up), then the learner, then Redis."""
        for name in list(self.nodes):
            self.stop_node(name)
        if self.learner is not None:
            _stop(self.learner.process, STOP_GRACE_S)
        if not keep_redis:
            self.stop_redis()

    def stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.stop()


def _stop(process: subprocess.Popen, timeout_s: float) -> int | None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    return process.returncode


def _with(cfg: Config, section: str, **fields) -> Config:
    import msgspec

    return msgspec.structs.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section), **fields)})
