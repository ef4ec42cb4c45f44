"""Shared fixtures. Each role's fixtures live in the section marked for it."""

from __future__ import annotations

import asyncio
import os
import pathlib

# Before any vLLM import: in-process engines (~2 s start instead of ~14 s) and no torch.compile
# on the first logprobs request (10-16 s). See FINDINGS.md.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The built-in tiny Qwen2 (seed 0), written once per test session."""
    from streamrl.engine.models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0))


@pytest.fixture(scope="module")
def loop():
    """An event loop of the test module's own, for async backends driven from plain test functions."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def demo_config(tmp_path):
    """`make(name, steps, *overrides)`: the demo's config for a CPU run in this test's folder."""
    from streamrl.engine.config import build
    from streamrl.ops.run import DEMO

    def make(name: str, steps: int, *extra: str):
        sets = [*DEMO, f"run.dir='{tmp_path}'", f"run.name='{name}'", f"run.steps={steps}", "run.device='cpu'"]
        return build({}, [*sets, "telemetry.tensorboard=false", *extra])

    return make


@pytest.fixture
def compiled_trainer(tiny_model, monkeypatch):
    """`make(backend, **learner)`: a Trainer over the tiny model with its decoder layers compiled by
    `backend` (dynamo on for this test only: this file turns it off for vLLM's sake); dynamo's caches
    are dropped before and after, so each test compiles afresh."""
    import torch
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    from streamrl.engine.config import LearnerConfig, LossConfig
    from streamrl.learner import parallel
    from streamrl.learner.train_step import Trainer

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # read when a module is compiled
    torch._dynamo.reset()

    def make(backend: str, **learner) -> Trainer:
        compile_with = torch.nn.Module.compile
        monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_with(self, backend=backend))
        device = parallel.init_distributed()
        lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
        cfg = LearnerConfig(lr=1e-3, compile=True, **learner)
        return Trainer(parallel.wrap_model(lm, cfg, device), LossConfig(), cfg, device)

    yield make
    torch._dynamo.reset()


@pytest.fixture
def steps_of_new_shapes():
    """`run(trainer, steps)`: that many steps over micro-batches of sizes, sequence counts and longest
    sequences the trainer has not seen, a recompile an error; the steps' metrics."""
    import torch._dynamo

    from streamrl.engine.messages import Trajectory
    from streamrl.learner.batching import pack

    def sample(k: int, i: int) -> Trajectory:
        n = 7 * k + i  # completion tokens: step k's sequences are longer than step k-1's
        return Trajectory(sample_id=f"s{k}-{i}", group_id="g", node_id="n", seq=i, prompt_ids=[3, 4, 5 + i],
                          completion_ids=list(range(10, 10 + n)), behavior_logprobs=[-6.0] * n, reward=0.0,
                          policy_version=0)  # fmt: skip

    def run(trainer, steps: int = 4) -> list[dict]:
        budget = trainer.cfg.micro_batch_tokens
        out = []
        with torch._dynamo.config.patch(error_on_recompile=True):
            for k in range(1, steps + 1):
                trajectories = [sample(k, i) for i in range(3 * k)]
                advantages = [(-1.0) ** i for i in range(len(trajectories))]
                out.append(trainer.step(pack(trajectories, advantages, budget, pad_multiple=budget // 8)))
        return out

    return run


@pytest.fixture(scope="session")
def planted_weights():
    """`plant(model, token, device)`: a copy of `model`'s weights (on `device`) under which every next
    token is `token` (residual = embedding; that token's row is the larger)."""

    def plant(model, token: int, device=None) -> dict:
        state = {k: v.detach().to(device or v.device, copy=True) for k, v in model.state_dict().items()}
        for name, t in state.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
            elif name.endswith("norm.weight"):
                t.fill_(1.0)
        state["model.embed_tokens.weight"].fill_(1.0)
        state["model.embed_tokens.weight"][token] = 2.0
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    return plant


# ---- preflight fixtures ----


@pytest.fixture(scope="session")
def llama_head_dim_16(tmp_path_factory) -> str:
    """A tiny Llama (untied head) whose heads are 16 wide: hidden 32 / 2 heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamrl.engine.models import make_tokenizer

    folder = tmp_path_factory.mktemp("models") / "llama-hd16"
    tokenizer = make_tokenizer(seed=0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


# ---- ledger / Redis fixtures (owned by the ledger work) ----


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One embedded Redis for the session (engine/redis_server.py, as the product starts it)."""
    from streamrl.engine.redis_server import RedisServer

    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server's URL, emptied for this test; afterwards every run's books must balance."""
    from streamrl.engine.redis_server import connect

    client = connect(redis_server.url)
    client.flushdb()
    yield redis_server.url
    assert_books_balance(client)
    client.close()


def assert_books_balance(client) -> None:
    """Fail when any run's ledger on this server has total != trained + dropped + in flight."""
    from streamrl.engine.ledger import Ledger

    runs = {key.split(":")[1] for key in client.scan_iter(match="streamrl:*:counts")}
    errors = {run: Ledger(client, run).check(deep=True) for run in sorted(runs)}
    errors = {run: e for run, e in errors.items() if e}
    assert not errors, f"ledger books do not balance after the test: {errors}"


@pytest.fixture
def ledger_run(request) -> str:
    """A run id unique to the test (several runs share the session's server)."""
    import re

    return re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:80]


class FakeLearner:
    """The learner's sockets without a learner: answers `Register` with a `Welcome` (version 0) that
    points at a real trajectory socket and a real ledger, so a real rollout node runs against it."""

    def __init__(self, redis_url: str, run: str):
        import threading

        from streamrl.engine.control import ControlServer
        from streamrl.engine.ledger import Ledger
        from streamrl.engine.redis_server import connect
        from streamrl.engine.transport import TrajectoryReceiver

        self.ledger = Ledger(connect(redis_url), run)
        self.ledger.init_run(groups_per_step=4)
        self.redis_url, self.run = redis_url, run
        self.receiver = TrajectoryReceiver()
        self.control = ControlServer()
        self.messages: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> str:
        return self.control.addr

    def _serve(self) -> None:
        from streamrl.engine.messages import Register, Welcome

        while not self._stop.is_set():
            got = self.control.recv(0.05)
            if got is None:
                continue
            peer, msg, _ = got
            self.messages.append(msg)
            if isinstance(msg, Register):
                welcome = Welcome(node_id=msg.node_id, trajectory_addr=self.receiver.addr, redis_url=self.redis_url,
                                  run_name=self.run, policy_version=0)  # fmt: skip
                self.control.send(peer, welcome)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.control.close()
        self.receiver.close()


@pytest.fixture(scope="session")
def fake_learner_cls():
    """The class itself, for module-scoped fixtures (conftest is not importable under importlib mode)."""
    return FakeLearner


@pytest.fixture
def fake_learner(redis_url, ledger_run):
    learner = FakeLearner(redis_url, ledger_run)
    yield learner
    learner.close()


# ---- learner fixtures ----
def _torchrun(ranks: int, script, *args, timeout_s: float = 300.0) -> str:
    """Run `script args...` on `ranks` CPU ranks under torchrun; its output, or a failed test that
    shows it. The whole process group is stopped on timeout (by its own pid)."""
    import signal
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        str(script),
        *map(str, args),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    label = f"torchrun {' '.join(map(str, args[-2:]))} on {ranks} ranks"
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            os.killpg(proc.pid, sig)
            try:
                output, _ = proc.communicate(timeout=20)
                break
            except subprocess.TimeoutExpired:
                continue
        pytest.fail(f"{label} timed out:\n{output[-3000:]}")
    assert proc.returncode == 0, f"{label} failed (rc {proc.returncode}):\n{output[-3000:]}"
    return output


@pytest.fixture(scope="session")
def torchrun():
    """`_torchrun` (session-wide: a module's fixture may run its workers once for several tests)."""
    return _torchrun


# ---- leftover processes: the session fails when a process it started outlives it ----
# An orphan (reparented to pid 1) that was not there when the session began, is ours, and runs in
# this checkout or under this session's temp folder was started by this session and left behind
# (e.g. a killed node's `VLLM::EngineCore`). It is reported, the session fails, and it is killed
# by its pid. Orphans get a grace period first: a child that watches its dead parent needs a moment.

_LEFTOVER_GRACE_S = 10.0
_PIDS_AT_START = {int(p) for p in os.listdir("/proc") if p.isdigit()}
_leftovers: dict[int, str] = {}


def _orphans_of_this_session(roots: list[str]) -> dict[int, str]:
    found = {}
    for entry in os.listdir("/proc"):
        pid = int(entry) if entry.isdigit() else 0
        if not pid or pid in _PIDS_AT_START:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]  # the name before ")" may hold spaces
            if ppid != "1" or state == "Z" or os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            cwd = os.readlink(f"/proc/{pid}/cwd")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked, or not ours to read
        if any(cwd == root or cwd.startswith(root + os.sep) for root in roots):
            found[pid] = f"{cmdline[:150]} (cwd {cwd})"
    return found


def pytest_sessionfinish(session, exitstatus):
    import signal
    import time

    if not os.path.isdir("/proc"):
        return
    roots = [str(session.config.rootpath)]
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None and factory._basetemp is not None:
        roots.append(str(factory.getbasetemp().resolve()))
    deadline = time.monotonic() + _LEFTOVER_GRACE_S
    while (left := _orphans_of_this_session(roots)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        _leftovers.update(left)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def pytest_terminal_summary(terminalreporter):
    if _leftovers:
        terminalreporter.section("processes left behind", red=True)
        for pid, what in sorted(_leftovers.items()):
            terminalreporter.line(f"pid {pid}: {what} (orphaned; killed now)", red=True)
        terminalreporter.line(
            f"{len(_leftovers)} process(es) started by this session outlived it: the session fails", red=True
        )


# ---- rollout nodes in processes of their own (the weight paths) ----


@pytest.fixture
def hf_nodes(tmp_path):
    """`start(node_id, model, device, backend="hf")`: a node process (tests/integration/hf_node_worker.py, whose
    `FakeRegistry` and `wait_for` are `start.harness`), killed after the test."""
    import importlib.util

    path = pathlib.Path(__file__).parent / "integration" / "hf_node_worker.py"
    spec = importlib.util.spec_from_file_location("hf_node_worker", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    started = []

    def start(node_id: str, model: str, device: str = "cpu", backend: str = "hf"):
        started.append(harness.NodeProc(node_id, model, device, tmp_path / f"{node_id}.log", backend))
        return started[-1]

    start.harness = harness
    yield start
    for proc in started:
        proc.close()
