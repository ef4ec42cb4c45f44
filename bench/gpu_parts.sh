#!/usr/bin/env bash
# Fewer device calls for what a GPU session carries: ../shared/tools/vllm-gpu-parts.sh packs vLLM in parts of
# 40 MiB (five calls); a call carries 64 MiB with the working tree (~2 MiB), so this re-packs the same bundle
# in three parts of 60 MiB (.vpA .vpB .vpC; vllm-setup.sh's checksum is over their concatenation, unchanged)
# and bench/gpu_trl.sh's wheels in two (.whl-trl1: all but pyarrow and pandas; .whl-trl2: those two, 58 MiB).
# Run it here, in the project root, after ../shared/tools/vllm-gpu-parts.sh, ../shared/tools/gpu-wheels.sh and
# (for TRL) `bench/gpu_trl.sh fetch`; it prints the calls. The 2026-12-05 session used exactly these.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
ls .vp[0-9]*/part* > /dev/null 2>&1 || { echo "no .vp0.. parts: run ../shared/tools/vllm-gpu-parts.sh first"; exit 2; }
grep -qxF '/.whl-trl*/' .git/info/exclude || echo '/.whl-trl*/' >> .git/info/exclude
bundle=$(mktemp); trap 'rm -f "$bundle"' EXIT
cat .vp[0-9]*/part* > "$bundle"
rm -rf .vpA .vpB .vpC; mkdir -p .vpA .vpB .vpC
part=63000000
cut() { dd if="$bundle" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count="$3"} status=none; }
cut .vpA/part00 0 "$part"
cut .vpB/part01 "$part" "$part"
cut .vpC/part02 $((2 * part))
rm -rf .vp[0-9]*
if [ -d .whl-trl ]; then
  rm -rf .whl-trl1 .whl-trl2; mkdir -p .whl-trl1 .whl-trl2
  for f in .whl-trl/*.whl; do
    case $f in *pyarrow*|*pandas*) cp "$f" .whl-trl2/ ;; *) cp "$f" .whl-trl1/ ;; esac
  done
fi
du -sh .vpA .vpB .vpC .whl .whl-trl1 .whl-trl2 2>/dev/null
cat <<'CALLS'
The device calls, back to back (a machine goes back 30 s after a call):
  run  mkdir -p /root/vparts && cp .vpA/* /root/vparts/                                  carry [".vpA"]
  run  mkdir -p /root/vparts && cp .vpB/* /root/vparts/                                  carry [".vpB"]
  run  mkdir -p /root/vparts /root/trlwheels && cp .vpC/* /root/vparts/ && cp .whl-trl1/* /root/trlwheels/ &&
       source .vp-setup/vllm-setup.sh && python3 -m pip install -q --no-index --no-deps --no-compile
       --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; ln -sfn $PWD /tmp/site/streamrl &&
       export PYTHONPATH=/tmp/site:$PYTHONPATH && PARTS=... bash bench/gpu_vllm.sh
                                                     carry [".vpC", ".whl", ".whl-trl1", ".vp-setup"]
  run  cp .whl-trl2/* /root/trlwheels/ && source .vp-setup/vllm-setup.sh && python3 -m pip install -q
       --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /root/trlwheels/*.whl;
       ln -sfn $PWD /tmp/site/streamrl && export PYTHONPATH=/tmp/site:$PYTHONPATH && bash bench/gpu_trl.sh
                                                     carry [".whl-trl2", ".vp-setup"]
  later calls: source .vp-setup/vllm-setup.sh, the ln and PYTHONPATH again    carry [".vp-setup"]
CALLS
