"""Fixtures of the integration tests beside tests/conftest.py's: a small disk (the full-disk tests), and the
launchers a test started (stopped whatever the test's outcome)."""

from __future__ import annotations

import os
import pathlib

import pytest

# Mounts a tmpfs of size $1 on folder $2, runs the rest of the command there, then copies what the folder
# holds (not `filler`, the test's own fill) to $KEEP: the mount is private to the command's mount
# namespace and ends with it, so nothing is left mounted whatever happens to the test.
_SMALL_DISK = (
    'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 97; disk="$2"; shift 2; "$@"; code=$?; '
    'if [ -n "$KEEP" ]; then rm -f "$disk/filler"; cp -a "$disk/." "$KEEP/"; fi; exit $code'
)


@pytest.fixture(scope="session")
def small_disk():
    """`wrap(folder, kib) -> [command prefix]`: a command run under the prefix sees a real filesystem of `kib`
    KiB at `folder` (a tmpfs in a mount namespace of its own: `unshare --mount` as root, with
    `--user --map-root-user` otherwise). Skipped, saying why, where neither can mount one (a container
    without CAP_SYS_ADMIN whose kernel refuses unprivileged user namespaces): then no test here can fill a
    real disk, and none pretends to."""
    import shutil
    import subprocess

    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]

    def wrap(folder, kib: int) -> list[str]:
        return ["unshare", *flags, "sh", "-c", _SMALL_DISK, "small-disk", f"{kib}k", str(folder)]

    probe = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    if shutil.which("unshare") is None:
        pytest.skip("no small disk: `unshare` (util-linux) is not installed, so no tmpfs can be mounted for a test")
    tried = subprocess.run([*wrap(probe, 64), "true"], capture_output=True, text=True, env={**os.environ, "KEEP": ""})
    if tried.returncode != 0:
        pytest.skip(f"no small disk: `{' '.join(wrap(probe, 64))} true` failed here ({tried.stderr.strip()})")
    return wrap


@pytest.fixture
def launched():
    """A list the test appends each `ops.launcher.Launcher` it starts to; every one is stopped afterwards."""
    started: list = []
    yield started
    for launcher in started:
        launcher.stop_all()
