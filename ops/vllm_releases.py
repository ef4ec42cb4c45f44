"""Which vLLM releases are built on which torch: each release's wheel pins one torch exactly, so a machine that has
a CUDA torch already (a cluster image, the lent GPU machines) takes the vLLM built on it instead of replacing its
torch. `install.sh gpu` runs this file alone (before streamrl is installed), so it imports nothing of streamrl.

    python ops/vllm_releases.py 2.11.0+cu130    # -> vllm>=0.25,<0.27
"""

from __future__ import annotations

import sys

# torch minor -> the vLLM releases whose wheels pin it (seen on PyPI, 2026-12-02; 0.25.1 run on an H200 here)
BUILT_ON = {"2.11": "vllm>=0.25,<0.27", "2.13": "vllm>=0.27,<0.33", "2.14": "vllm>=0.33,<0.34"}


def for_torch(version: str) -> str:
    """The pip requirement of the vLLM releases built on torch `version` (e.g. '2.11.0+cu130'); ValueError naming
    the torch releases that have one when none is."""
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor not in BUILT_ON:
        have = ", ".join(f"torch {t}: {spec}" for t, spec in BUILT_ON.items())
        raise ValueError(f"no vLLM release is built on torch {version} (known: {have})")
    return BUILT_ON[minor]


if __name__ == "__main__":
    try:
        print(for_torch(sys.argv[1]))
    except (IndexError, ValueError) as e:
        print(e if isinstance(e, ValueError) else "usage: python ops/vllm_releases.py TORCH_VERSION", file=sys.stderr)
        sys.exit(2)
