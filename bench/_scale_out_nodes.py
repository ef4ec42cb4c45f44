"""The simulated rollout nodes of bench/scale_out.py: processes of several nodes each, and their CPU time.

    python -m streamrl.bench._scale_out_nodes CONFIG LEARNER_ADDR FIRST COUNT

runs nodes FIRST ... FIRST + COUNT - 1 of a run in this process until the learner stops them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import pathlib
import subprocess
import sys
import time

from streamrl.engine.config import load
from streamrl.ops.launcher import Launcher, child_env


def start_workers(launcher: Launcher, n: int, per_worker: int) -> list[subprocess.Popen]:
    """`n` nodes in processes of `per_worker` nodes each (node-0 ... node-{n-1})."""
    addr = launcher.learner_address()["control_addr"]
    env = child_env(launcher.cfg, launcher.tmp)
    workers = []
    for first in range(0, n, per_worker):
        count = min(per_worker, n - first)
        log_path = launcher.run_dir / "logs" / f"workers-{first}.out"
        command = [sys.executable, "-m", "streamrl.bench._scale_out_nodes", str(launcher.config_path), addr]
        with log_path.open("ab") as out:
            workers.append(subprocess.Popen([*command, str(first), str(count)], stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True))  # fmt: skip
    return workers


def ended(process: subprocess.Popen, deadline: float) -> int | None:
    """The exit status of a node process the learner stopped, or None: still running at `deadline`, killed."""
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


def worker(config_path: str, learner_addr: str, first: int, count: int) -> int:
    """Nodes `first` ... `first + count - 1` in this process, each the product's `serve`, until the
    learner stops them. They share one tokenizer (read only: it decodes completions for the reward)."""
    from streamrl.engine import models
    from streamrl.rollout.service import serve

    models.load_tokenizer = functools.cache(models.load_tokenizer)  # loaded once a process: 32 loads took minutes
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load(config_path, [])

    async def all_nodes() -> list:
        # asyncio.to_thread's pool, as many threads a node as a node's own process has (min(32, cores + 4))
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(6 * count))
        ids = [f"node-{i}" for i in range(first, first + count)]
        return await asyncio.gather(*(serve(cfg, learner_addr, node_id) for node_id in ids), return_exceptions=True)

    # not asyncio.run: its end waits for every pool thread, and a node whose receive of a last version met the
    # stopped learner's closed store waits in its connect (weights.timeout_s, twice); the process exits anyway
    failed = [r for r in asyncio.new_event_loop().run_until_complete(all_nodes()) if isinstance(r, BaseException)]
    for error in failed:
        print(f"node failed: {type(error).__name__}: {error}", flush=True)
    return 1 if failed else 0


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (its threads included)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> int:
    """Threads of process `pid` now (the learner's: one weights link per node it serves with a link)."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def cpu_seconds(learner, workers: list[subprocess.Popen]) -> tuple[float, float]:
    """CPU seconds so far of the learner and of every node process together."""
    return process_cpu_s(learner.pid), sum(process_cpu_s(w.pid) for w in workers)


if __name__ == "__main__":
    code = worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)  # without joining the pool's threads (above)
