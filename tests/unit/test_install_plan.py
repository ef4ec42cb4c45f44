"""`./install.sh gpu` on a machine with a CUDA torch keeps that torch and takes the vLLM built on it; elsewhere the
CPU or upstream builds (the plan the script prints with STREAMRL_INSTALL_PLAN=1, installing nothing)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from streamrl.ops.vllm_releases import for_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_each_torch_gets_the_vllm_releases_built_on_it():
    assert for_torch("2.11.0+cu130") == "vllm>=0.25,<0.27"  # 0.25.1, run on the lent H200s
    assert for_torch("2.13.0") == "vllm>=0.27,<0.33"
    assert for_torch("2.14.1+cu128") == "vllm>=0.33,<0.34"
    with pytest.raises(ValueError, match=r"no vLLM release is built on torch 2.12.0 \(known: torch 2.11"):
        for_torch("2.12.0")


def _plan(tmp_path, kind: str, torch_version: str) -> subprocess.CompletedProcess:
    """install.sh's plan with a `python3` first on PATH whose torch reports `torch_version` ('' : no CUDA torch)."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    answer = f'if [ "$1" = -c ]; then echo "{torch_version}"; exit 0; fi'
    fake.write_text(f'#!/bin/sh\n{answer}\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", STREAMRL_INSTALL_PLAN="1")
    return subprocess.run([str(ROOT / "install.sh"), kind], env=env, capture_output=True, text=True, timeout=60)


def test_a_cuda_torch_is_kept_and_gets_its_vllm(tmp_path):
    done = _plan(tmp_path, "gpu", "2.11.0+cu130")
    assert done.returncode == 0, done.stderr
    assert "keeping it, with vllm>=0.25,<0.27" in done.stdout
    assert "--system-site-packages; extras [data,test,wandb,envs]; pins vllm>=0.25,<0.27" in done.stdout


def test_without_a_cuda_torch_gpu_takes_upstream_vllm_and_a_torch_with_no_vllm_is_refused(tmp_path):
    done = _plan(tmp_path, "gpu", "")
    assert done.returncode == 0 and "extras [gpu,data,test,wandb,envs]; pins none" in done.stdout
    (tmp_path / "other").mkdir()
    refused = _plan(tmp_path / "other", "gpu", "2.12.0+cu126")
    assert refused.returncode == 2 and "no vLLM release is built on torch 2.12.0+cu126" in refused.stderr
    assert "this machine's torch is 2.12.0+cu126" in refused.stderr
