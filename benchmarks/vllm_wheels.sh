#!/usr/bin/env bash
# vLLM for the GPU machine, in parts a device call can carry. Run HERE (a box that reaches the package
# index); benchmarks/vllm_device_install.sh joins and installs them THERE.
#
# The GPU image has torch 2.11.0+cu130 and CPython 3.12 but no vLLM, and a call carries at most 64 MiB.
# vllm 0.26.0 pins torch 2.11.0 and its kernels link CUDA 13, so it runs on the image's torch. This script:
#   1. downloads vllm 0.26.0's wheel (cp38-abi3 manylinux_2_28 x86_64, 290 MiB) with --no-deps;
#   2. repacks it slim (benchmarks/vllm_slim_wheel.py says what is left out and why: 100 MiB) and cuts it
#      into parts of at most 58 MiB, one folder each: benchmarks/.gpu_wheels/vllm/part-NN/;
#   3. downloads the wheels vLLM imports that the image lacks (benchmarks/vllm_deps.txt, 17 MB) into
#      benchmarks/.gpu_wheels/vllm/deps/.
# Then, on one warm GPU machine, three calls in a row (the machine is given back ~30 s after a call):
#   call 1  carry benchmarks/.gpu_wheels/vllm/part-00                               command: true
#   call 2  carry benchmarks/.gpu_wheels/vllm/part-01, benchmarks/.gpu_wheels/vllm/deps
#           command: bash benchmarks/vllm_device_install.sh
#   call 3  carry benchmarks/.gpu_wheels/wheels, benchmarks/.gpu_wheels/models     (bash benchmarks/gpu_wheels.sh)
#           command: bash benchmarks/gpu_smoke.sh --part vllm
# A call with more parts (a larger --part-mib, a newer vLLM) adds one carry per part before call 2.
#
#   bash benchmarks/vllm_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
VLLM=${VLLM_VERSION:-0.26.0}
DEST=benchmarks/.gpu_wheels/vllm
# pip matches a --platform tag exactly: name every manylinux the image's glibc runs
target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux1_x86_64
        --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 35); do target+=(--platform "manylinux_2_${n}_x86_64"); done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps "${target[@]}" -d "$tmp" "vllm==$VLLM"
rm -rf "$DEST"
"$PY" benchmarks/vllm_slim_wheel.py "$tmp"/vllm-"$VLLM"-*.whl "$DEST"
rm -f "$DEST"/vllm-*.whl  # the parts hold it

mkdir -p "$DEST/deps"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps "${target[@]}" -d "$DEST/deps" \
    -r benchmarks/vllm_deps.txt
cp benchmarks/vllm_deps.txt "$DEST/deps/"
du -sh "$DEST"/part-* "$DEST/deps"
