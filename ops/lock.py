"""One owner per run folder: `RUN/owner.lock`, held with an exclusive `flock` by whoever writes the folder.

The launcher (`streamrl run`) takes it before it touches anything of the folder (config.toml, the embedded
Redis, end.json, learner.json), and so does a learner started on its own (`streamrl learner`). The lock is
the kernel's: it is released when the last descriptor of it closes, so a killed owner never leaves a stale
lock, and the file's text (pid, host, start time, command) only says who held it last. A launcher hands its
hold to the learner it starts (an inherited descriptor, named in `OWNER_FD`): the learner owns the folder
with it, and keeps owning it if the launcher dies first.

A second owner is refused at once (`RunBusyError`), naming the live one and the two ways on. `streamrl
status` probes the lock (`holder`) and reads a live run through its running ledger, never through a server
of its own on the live files. flock over NFS and across hosts: docs/DEPLOY.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import socket
import sys
import time

LOCK_FILE = "owner.lock"
OWNER_FD = "STREAMRL_OWNER_FD"  # the descriptor of the hold a launcher handed to its learner
# A prober (`holder`) holds a shared lock for microseconds: a second or so of retries tells it from an owner.
TAKE_TRIES, TAKE_WAIT_S = 10, 0.1


class RunBusyError(RuntimeError):
    """The run folder has a live owner; the message is the one line a person reads."""

    def __init__(self, run_dir: pathlib.Path, held_by: dict):
        self.run_dir, self.held_by = run_dir, held_by
        name = run_dir.name
        super().__init__(
            f"run {name!r} is live in {run_dir} ({describe(held_by)}): nothing was started or changed; "
            f"follow it with `streamrl status --run {name} --runs-dir {run_dir.parent}`, or start another run "
            f"with --set run.name=OTHER"
        )


def describe(held_by: dict) -> str:
    """`pid 123 on host h since 12:00:01: streamrl run ...` (what the lock file says)."""
    if not held_by:
        return "its owner did not say who it is yet"
    since = time.strftime("%H:%M:%S", time.localtime(float(held_by.get("started", 0.0))))
    return f"pid {held_by.get('pid')} on {held_by.get('host')} since {since}: {held_by.get('command', '?')}"


class RunOwner:
    """This process's hold on a run folder (`take`, or `inherited` from the launcher that started it)."""

    def __init__(self, run_dir: pathlib.Path, fd: int, inherited: bool = False, made: tuple = ()):
        self.run_dir, self.fd, self.inherited_hold = run_dir, fd, inherited
        self.made = made  # the folders this hold made (the run's, then its parents'): `abandon` removes them

    def __enter__(self) -> RunOwner:
        return self

    def __exit__(self, kind, error, trace) -> None:
        """Released; a command that failed before it wrote anything but the lock (a refused preflight) leaves
        no folder behind (`typer.Exit`'s code says whether it failed)."""
        if error is not None and getattr(error, "exit_code", 1) != 0:
            self.abandon()
        self.release()

    def abandon(self) -> None:
        """Remove the folders this hold made, when the lock file is all they hold."""
        if not self.made or [p.name for p in self.run_dir.iterdir()] != [LOCK_FILE]:
            return
        (self.run_dir / LOCK_FILE).unlink()
        with contextlib.suppress(OSError):  # a folder someone else wrote to meanwhile stays
            for folder in self.made:
                folder.rmdir()

    @classmethod
    def take(cls, run_dir: pathlib.Path, command: str = "") -> RunOwner:
        """The folder's lock (the folder made if missing), or RunBusyError naming the live owner. Nothing in the
        folder is written unless the lock is ours: the lock file is opened without truncating."""
        run_dir = pathlib.Path(run_dir)
        made = tuple(folder for folder in (run_dir, *run_dir.parents) if not folder.exists())
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        for attempt in range(TAKE_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == TAKE_TRIES - 1:
                    os.close(fd)
                    raise RunBusyError(run_dir, _said(run_dir)) from None
                time.sleep(TAKE_WAIT_S)
        said = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(said) + "\n").encode(), 0)
        return cls(run_dir, fd, made=made)

    @classmethod
    def inherited(cls, run_dir: pathlib.Path) -> RunOwner | None:
        """The hold the launcher that started this process handed it (`OWNER_FD`), when it is this folder's
        lock file; None otherwise (then this process must `take` it)."""
        given = os.environ.get(OWNER_FD, "")
        if not given.isdigit():
            return None
        try:
            same = os.path.samestat(os.fstat(int(given)), os.stat(pathlib.Path(run_dir) / LOCK_FILE))
        except OSError:
            return None
        return cls(pathlib.Path(run_dir), int(given), inherited=True) if same else None

    def handed(self) -> tuple[dict[str, str], tuple[int, ...]]:
        """What a child that shares this hold needs: its environment entry and the descriptor to pass on."""
        return {OWNER_FD: str(self.fd)}, (self.fd,)

    def release(self) -> None:
        """Give the folder up (the lock also ends with the process). Unlocking ends the one lock for every
        descriptor of it, the child's it was handed to too; a hold that was handed to this process is only
        closed: the launcher that handed it still owns the folder."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            if not self.inherited_hold:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        self.fd = -1


def take_or_inherit(run_dir: pathlib.Path) -> RunOwner:
    """A process that writes the folder: the hold its launcher handed it, else its own (RunBusyError when
    another process owns the folder)."""
    return RunOwner.inherited(run_dir) or RunOwner.take(run_dir, command=this_command())


def this_command() -> str:
    """This process's command as a person would type it (`streamrl run --set ...`)."""
    args = sys.argv[1:] if sys.argv and sys.argv[0].endswith(("streamrl", "__main__.py")) else sys.argv
    return " ".join(["streamrl", *args])


def holder(run_dir: pathlib.Path) -> dict | None:
    """Who owns the run folder now (the lock file's words, {} before it wrote them), or None when no process
    does. Probed with a shared lock held for microseconds (`RunOwner.take` retries past it); the file is
    neither made nor written."""
    path = pathlib.Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return _said(run_dir)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return None


def _said(run_dir: pathlib.Path) -> dict:
    try:
        return json.loads((pathlib.Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return {}  # the owner took the lock and has not written its words yet


def own_or_refuse(run_dir: pathlib.Path) -> RunOwner | None:
    """`streamrl learner`'s hold on its run folder (handed by its launcher, else its own, kept across an exec
    into torchrun); None, with the one line said on stderr, while another process owns the folder."""
    try:
        owner = take_or_inherit(run_dir)
    except RunBusyError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return None
    os.set_inheritable(owner.fd, True)  # torchrun, exec'd in this process for learner.ranks > 1, keeps it
    return owner


def claim_run(cfg, explicit_name: bool, resume: str = ""):
    """`streamrl run`'s hold on its run folder, taken before the preflight loads anything (this module imports
    no torch), so that of two launchers started together on one run the second is refused in seconds: (the
    config, whose name made here gets a fresh folder when its own exists: `fresh_name`; the hold, which
    ops/run.py `run_local` hands to its launcher). None, with the one line said on stderr, while another process
    owns the folder: nothing in it was changed."""
    from streamrl.ops.naming import fresh_name

    cfg = fresh_name(cfg, explicit_name or bool(resume))
    try:
        return cfg, RunOwner.take(cfg.run.path, this_command())
    except RunBusyError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return None
