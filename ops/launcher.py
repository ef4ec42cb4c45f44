"""`streamrl run`: a whole run on one machine — embedded Redis, one learner, N rollout nodes.

Every child is a process of its own (`python -m streamrl learner`, `python -m streamrl rollout`),
writing to its own log in `RUN/logs/`; the console shows only the live view. Ctrl-C (or the
learner finishing) stops every child this launcher started, by pid: SIGTERM, a grace period, then
SIGKILL. Nodes can be added (`add_node`) or stopped (`stop_node`)
while the run goes on.

The grace outlasts a node's own bound on stopping (`stop_grace_s`, from the config), so a node is
killed only when it broke its bound; once a node it stopped is gone, the launcher resolves in the
ledger whatever the node still held (`node_lost`): nothing else would deliver it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgspec

from streamrl.engine.auth import keys_folder, make_keys
from streamrl.engine.config import Config, dump
from streamrl.engine.ledger import Ledger, LedgerError, LedgerUnavailableError
from streamrl.engine.placement import Placement, plan, shared_gpu_share, visible_gpus
from streamrl.engine.redis_server import RedisServer, RedisUnavailableError, connect, write_private
from streamrl.engine.telemetry import read_ending, write_ending
from streamrl.ops.lock import RunOwner, this_command
from streamrl.rollout.service import stop_bound_s

log = logging.getLogger("streamrl.launcher")

_UNPLANNED = Placement(learner=[], nodes=[])  # start() plans the GPUs unless plan_gpus() ran first
EXIT_MARGIN_S = 10.0  # a process past its own bound still has to be reaped by the OS


def stop_grace_s(cfg: Config) -> float:
    """How long the launcher waits after SIGTERM before SIGKILL: a node's own bound on stopping (its grace
    for groups in flight, its ledger retries, closing: `rollout.service.stop_bound_s`), and a margin."""
    return stop_bound_s(cfg) + EXIT_MARGIN_S


@dataclasses.dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: pathlib.Path
    log_offset: int = 0  # where this process's output starts in the log (a resumed run appends)
    started: float = dataclasses.field(default_factory=time.time)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"


def child_env(cfg: Config, tmp: pathlib.Path) -> dict[str, str]:
    """In-process vLLM engines, no torch.compile on CPU, and vLLM's socket files kept in `tmp`."""
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if cfg.run.device != "cuda":
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
    return env


class Launcher:
    """Owns the run's processes; everything it starts, it stops."""

    def __init__(self, cfg: Config, resume: str = "", owner: RunOwner | None = None):
        """Owns the run folder first (ops/lock.py: RunBusyError, with nothing changed, while another
        process owns it; `owner`: the hold, taken already), then makes its logs folder."""
        self.cfg = cfg
        self.resume = resume  # the learner's --resume: a checkpoint folder or "latest"
        self.run_dir = cfg.run.path
        self.owner = owner or RunOwner.take(self.run_dir, this_command())  # handed to the learner (`_spawn`)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.redis: RedisServer | None = None
        self.learner: Child | None = None
        self.nodes: dict[str, Child] = {}
        self.config_path = self.run_dir / "config.toml"
        # vLLM binds ipc:// sockets in TMPDIR, whose paths may not exceed 107 bytes: a short folder
        # of our own under the system temp dir (not the run folder), removed when the run ends.
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="streamrl-"))
        self._next_node = 0
        self.placement: Placement | None = _UNPLANNED
        self._planned_nodes = 1  # the nodes plan_gpus placed (their share of a GPU they share)
        self._ledger: Ledger | None = None

    def plan_gpus(self, nodes: int) -> Placement | None:
        """Each role's GPU (None on CPU); raises ConfigError naming the fields of a placement that cannot be."""
        self._planned_nodes = nodes
        gpus = visible_gpus() if self.cfg.run.device in ("auto", "cuda") else 0
        if gpus == 0 and self.cfg.run.device != "cuda":
            self.placement = None
        else:
            self.placement = plan(self.cfg, gpus, nodes)
        return self.placement

    def start(self, nodes: int, timeout_s: float = 300.0) -> None:
        """Redis, the learner, and once it is up `nodes` rollout nodes (blocking; `streamrl run` does
        the same steps one by one to show each)."""
        if self.placement is _UNPLANNED:
            self.plan_gpus(nodes)
        self.start_redis()
        self.start_learner()
        self.wait_for_learner(timeout_s)
        for _ in range(nodes):
            self.add_node()

    def start_redis(self) -> None:
        """The embedded Redis unless ledger.url names one; then the run's config.toml, with its URL."""
        if not self.cfg.ledger.url:
            self.redis = RedisServer(self.run_dir / "redis")
            self.cfg = _with(self.cfg, "ledger", url=self.redis.start())
        write_private(self.config_path, dump(self.cfg))  # 0600: ledger.url holds the run's Redis password

    def start_learner(self) -> None:
        """The learner, with the run's CURVE keys in RUN/keys made first (unless transport.keys names a
        folder): every role of the run starts with them."""
        if self.cfg.transport.curve and not self.cfg.transport.keys:
            make_keys(keys_folder(self.cfg))
        self.learner = self._spawn("learner", self._learner_command(), self._learner_gpus(), owner=True)

    def _learner_command(self) -> list[str]:
        """`streamrl learner`, which becomes torchrun itself when learner.ranks > 1; `streamrl run`
        ran the preflight for every role already."""
        resume = ["--resume", self.resume] if self.resume else []
        command = ["learner", "--config", str(self.config_path), "--no-preflight", *resume]
        return [sys.executable, "-m", "streamrl", *command]

    def node_arguments(self) -> list[str]:
        """`streamrl rollout ...` for a node of this run (the launcher's nodes add a name)."""
        return ["rollout", "--config", str(self.config_path), "--learner", str(self.run_dir)]

    def node_command(self) -> str:
        """The command that starts one more node of this run by hand, as a user types it."""
        return "streamrl " + shlex.join(self.node_arguments())

    def restart_learner(self, resume: str = "latest", timeout_s: float = 300.0) -> None:
        """A new learner for this run after the last one died, continuing from checkpoint `resume`."""
        if self.learner is not None and self.learner.alive:
            raise RuntimeError("the learner is still running: stop it before starting another")
        self.resume = resume
        self.learner = self._spawn("learner", self._learner_command(), self._learner_gpus(), owner=True)
        self.wait_for_learner(timeout_s)

    def _learner_gpus(self) -> list[int] | None:
        if self.placement is _UNPLANNED:
            self.plan_gpus(nodes=1)
        return self.placement.learner if self.placement is not None else None

    def _node_gpu(self, index: int) -> list[int] | None:
        if self.placement is _UNPLANNED:
            self.plan_gpus(nodes=1)
        return [self.placement.node_gpu(index)] if self.placement is not None else None

    def wait_for_learner(self, timeout_s: float) -> dict:
        """The learner's addresses, once it wrote them; a clear error if it died or took too long."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.learner.alive:
                raise RuntimeError(
                    f"the learner exited with code {self.learner.process.returncode} before it "
                    f"was up; its log {self.learner.log_path}:\n{self.learner.log_tail()}"
                )
            address = self.learner_address()
            if address is not None:
                return address
            time.sleep(0.2)
        raise RuntimeError(
            f"the learner was not up after {timeout_s:.0f} s; its log {self.learner.log_path}:\n"
            f"{self.learner.log_tail()}"
        )

    def learner_address(self) -> dict | None:
        """The addresses this learner wrote to RUN/learner.json once its sockets were up; None before."""
        path = self.run_dir / "learner.json"
        if self.learner is None or not path.is_file() or path.stat().st_mtime < self.learner.started - 1:
            return None
        return json.loads(path.read_text())

    def add_node(self) -> str:
        name = f"node-{self._next_node}"
        self._next_node += 1
        index = self._next_node - 1
        self.nodes[name] = self._spawn(f"rollout-{name}", self.node_process(name, index), self._node_gpu(index))
        return name

    def node_process(self, name: str, index: int) -> list[str]:
        """The command of launched node `index`: on a GPU that several vLLM nodes share, with its share of what
        the ledger admits (placement.shared_gpu_share)."""
        command = [sys.executable, "-m", "streamrl", *self.node_arguments(), "--node-id", name, "--no-preflight"]
        if self.placement not in (None, _UNPLANNED):
            command += shared_gpu_share(self.cfg, self.placement, self._planned_nodes, index)
        return command

    def stop_node(self, name: str, timeout_s: float | None = None) -> int | None:
        """SIGTERM, the node's grace (`stop_grace_s`, or `timeout_s`), SIGKILL; then what it still held
        in the ledger is resolved. Its exit status."""
        child = self.nodes.pop(name)
        code = _stop(child.process, stop_grace_s(self.cfg) if timeout_s is None else timeout_s)
        self.resolve_gone(name)
        return code

    def resolve_gone(self, name: str) -> int:
        """Drop, as `node_lost`, the samples a node that is gone still holds (a node that left cleanly
        holds none); how many. The ledger may be gone too (the run is ending): then 0."""
        if not self.ledger_url:
            return 0
        try:
            if self._ledger is None:
                ledger_cfg = msgspec.structs.replace(self.cfg.ledger, retry_s=min(self.cfg.ledger.retry_s, 5.0))
                self._ledger = Ledger(connect(self.ledger_url, retries=2), self.cfg.run.name, ledger_cfg)
            resolved = self._ledger.resolve_node(name, "node_lost")
        except (LedgerUnavailableError, LedgerError, RedisUnavailableError, OSError) as e:
            log.warning("node %s: its samples could not be resolved (%s)", name, e)
            return 0
        if resolved:
            log.warning("node %s was stopped holding %d samples: resolved as node_lost", name, resolved)
        return resolved

    def _spawn(self, name: str, command: list[str], gpus: list[int] | None = None, owner: bool = False) -> Child:
        """A child with its log; `owner`: it shares this launcher's hold on the folder (the learner, which
        would otherwise take the folder's lock itself and find it held)."""
        log_path = self.run_dir / "logs" / f"{name}.out"
        env = child_env(self.cfg, self.tmp)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        handed, fds = self.owner.handed() if owner else ({}, ())
        with log_path.open("ab") as out:
            offset = out.tell()
            # Own process group: a terminal's Ctrl-C reaches the launcher, which stops children in order.
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**env, **handed},
                start_new_session=True, pass_fds=fds,
            )  # fmt: skip
        return Child(name, process, log_path, offset)

    @property
    def ledger_url(self) -> str | None:
        return self.cfg.ledger.url or None

    def stop_all(self, keep_redis: bool = False) -> None:
        """Nodes first (they resolve their samples while the ledger is up), then the learner, then Redis.

        Every node is signalled before any is waited for, so they wind down together."""
        nodes = {name: self.nodes.pop(name).process for name in list(self.nodes)}
        for process in nodes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + stop_grace_s(self.cfg)
        for name, process in nodes.items():
            _stop(process, max(0.0, deadline - time.monotonic()))
            self.resolve_gone(name)
        if self.learner is not None:
            _stop(self.learner.process, stop_grace_s(self.cfg))
        if self._ledger is not None:
            self._ledger.client.close()
            self._ledger = None
        if not keep_redis:
            self.stop_redis()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def record_ending(self, last_error: str = "") -> dict | None:
        """RUN/end.json for a learner that exited without writing it (killed by a signal, a crash the learner
        did not catch): written here, so that every end of the run says how it ended; the ending either way
        (None while the learner runs). `last_error`: the learner's last error line, if any."""
        if self.learner is None or self.learner.alive:
            return None
        ending = read_ending(self.run_dir)
        if ending is not None and ending.get("time", 0.0) >= self.learner.started - 1:
            return ending  # the learner's own words
        code = self.learner.process.returncode
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else "?"
            how = f"learner killed (signal {-code}, {name})"
            how += ": by a person, or by the kernel out of memory (`dmesg` says which)" if -code == 9 else ""
        else:
            how = f"learner exit {code}" + (f": {last_error}" if last_error else f"; its log {self.learner.log_path}")
        code = 128 - code if code < 0 else code  # as a shell reports a signal
        written = write_ending(self.run_dir, "stopped without an ending", code, how, by="launcher")
        return {"ended": "stopped without an ending", "exit": code, "detail": how, "written": written}

    def failed_nodes(self) -> list[Child]:
        """Nodes that exited with an error (a node stopped by SIGTERM exits 0)."""
        return [c for c in self.nodes.values() if not c.alive and c.process.returncode not in (0, None)]

    def stop_redis(self) -> None:
        """The embedded Redis, last of the run's processes; then the folder is given up (`owner`)."""
        if self.redis is not None:
            self.redis.stop()
        self.owner.release()


def _stop(process: subprocess.Popen, timeout_s: float) -> int | None:
    """SIGTERM, `timeout_s`, SIGKILL; then whatever the child left in its session (every child is a
    session leader: its group is its pid), e.g. a vLLM EngineCore or a reward worker of a killed node."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left of it: the usual case
        pass
    return process.returncode


def _with(cfg: Config, section: str, **fields) -> Config:
    return msgspec.structs.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section), **fields)})
