"""The shipped Slurm batch script, submitted with `sbatch` to a one-node Slurm cluster this test starts.

The cluster is real (Debian's slurm-wlm: munged, slurmctld, slurmd in a folder of the test, on free
ports); the job starts Redis, `srun torchrun` the learner and an `srun` step of rollout nodes, and
must finish a short run whose books balance. The learner listens on this machine's own address, not
loopback, so the job runs as across hosts: CURVE keys and Redis over TLS. Without Slurm installed the
test fails naming the install, it does not skip.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow]

SCRIPT = pathlib.Path(__file__).parents[2] / "deploy" / "slurm" / "streamrl.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "srun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_address() -> str:
    """This machine's first non-loopback address (the job's learner host), else loopback."""
    words = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return next((w for w in words if ":" not in w and not w.startswith("127.")), "127.0.0.1")


class Slurm:
    """munged, slurmctld and slurmd for one node, all in `folder`; stopped by pid."""

    def __init__(self, folder: pathlib.Path):
        self.folder, self.processes = folder, []
        self.node = socket.gethostname()
        folder.mkdir()
        for sub in ("state", "spool", "munge"):
            (folder / sub).mkdir(mode=0o700)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = folder / "munge" / "munge.sock"
        self._start(["munged", "-F", "-f", f"--socket={self.socket}", f"--key-file={key}",
                     f"--pid-file={folder}/munge/munged.pid", f"--log-file={folder}/munge/munged.log",
                     f"--seed-file={folder}/munge/munged.seed"], "munged")  # fmt: skip
        self.conf = folder / "slurm.conf"
        self.conf.write_text(self._conf())
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._start(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        self._start(["slurmd", "-D", "-f", str(self.conf), "-N", self.node], "slurmd")
        self._wait_idle()

    def _conf(self) -> str:
        f = self.folder
        return "\n".join([
            "ClusterName=streamrltest", f"SlurmctldHost={self.node}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={self.socket}", "CredType=cred/munge",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}", f"StateSaveLocation={f}/state",
            f"SlurmdSpoolDir={f}/spool", f"SlurmctldPidFile={f}/slurmctld.pid", f"SlurmdPidFile={f}/slurmd.pid",
            f"SlurmctldLogFile={f}/slurmctld.log", f"SlurmdLogFile={f}/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE", "",
        ])  # fmt: skip

    def _start(self, command: list[str], name: str) -> None:
        with (self.folder / f"{name}.out").open("wb") as out:
            env = getattr(self, "env", os.environ)
            self.processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True))  # fmt: skip
        time.sleep(0.5)
        if self.processes[-1].poll() is not None:
            raise RuntimeError(f"{name} exited at start:\n{(self.folder / f'{name}.out').read_text()[-2000:]}")

    def _wait_idle(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node never became idle: {state.stdout} {state.stderr}")

    def close(self) -> None:
        subprocess.run(["scancel", "--full", f"--nodelist={self.node}"], env=self.env, capture_output=True)
        for process in reversed(self.processes):  # slurmd, slurmctld, munged
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)


@pytest.fixture
def slurm(tmp_path):
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm")
    cluster = Slurm(tmp_path / "slurm")
    yield cluster
    cluster.close()


def test_the_shipped_batch_script_runs_a_short_run_on_slurm(slurm, tmp_path, tiny_model):
    config = tmp_path / "run.toml"
    config.write_text("\n".join([
        "run.name = 'slurm'", "run.steps = 3", "run.device = 'cpu'", f"model.path = '{tiny_model}'",
        "rollout.backend = 'hf'", "rollout.group_size = 4", "rollout.max_tokens = 16", "learner.groups_per_step = 2",
        "telemetry.tensorboard = false", "",
    ]))  # fmt: skip
    host = _own_address()
    env = {**slurm.env, "STREAMRL_PYTHON": sys.executable, "STREAMRL_JOB_DIR": str(tmp_path / "job"),
           "STREAMRL_HOST": host}  # fmt: skip
    start = time.monotonic()
    job = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", f"--output={tmp_path}/job.out", str(SCRIPT), str(config)],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").is_file() else "(no output)"
    run_dir = tmp_path / "job" / "runs" / "slurm"
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(run_dir.glob("logs/*")))
    assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{out[-4000:]}\n{logs}"
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    took = time.monotonic() - start
    print(f"\nsbatch of the shipped script: {len(metrics)} steps in {took:.0f} s, learner at {host}")
    print(out[-1500:])
    assert f"learner on {slurm.node} at {host}" in out
    assert len(metrics) == 3 and "books balance: " in out and "do not balance" not in out
    if host != "127.0.0.1":  # beyond loopback: the job made keys and served the ledger over TLS
        assert (tmp_path / "job" / "keys" / "server.key_secret").is_file()
        assert "rediss://" in (tmp_path / "job" / "job.toml").read_text()
    assert (tmp_path / "job" / "job.toml").stat().st_mode & 0o077 == 0
