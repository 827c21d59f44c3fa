#!/usr/bin/env bash
# The GPU smoke suite in one command, for a machine with one CUDA GPU, a CUDA build of torch and
# transformers, and no internet (benchmarks/gpu_smoke.py says what each check does):
#
#   bash benchmarks/gpu_wheels.sh      # first, on a box that reaches the package index
#   (copy benchmarks/.gpu_wheels to the GPU machine's checkout)
#   bash benchmarks/gpu_smoke.sh --part 1   # on the GPU machine; parts 1, 2 and 3, each under 10 minutes
#   bash benchmarks/gpu_smoke.sh --part vllm   # after benchmarks/vllm_device_install.sh (see vllm_wheels.sh)
#
# Packages the checks import that the image lacks are installed from benchmarks/.gpu_wheels with
# --no-deps into a folder of their own (benchmarks/.gpu_wheels/site-cpXY, put on PYTHONPATH): the
# machine's environment is not touched. The model: $SMOKE_MODEL (a local HF directory) if set, else
# the SmolLM2-135M-Instruct or tiny-llama copy gpu_wheels.sh put in benchmarks/.gpu_wheels/models.
# Results: $OUT/gpu_smoke.json (runs/gpu_smoke/ without $OUT) and a last line `RESULT {...}`.
# Arguments go to gpu_smoke.py: --device cpu runs the same checks on a CPU (the CUDA-only ones skip).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WHEELS=benchmarks/.gpu_wheels
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# import name -> distribution, for each package switchyard needs beyond torch + transformers
NEEDED="zmq:pyzmq msgpack:msgpack xxhash:xxhash omegaconf:omegaconf"
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
SITE="$PWD/$WHEELS/site-$TAG"
# vLLM and what it imports, where benchmarks/vllm_device_install.sh put them (the `vllm` part's checks)
VLLM_SITE="$PWD/$WHEELS/vllm/site-$TAG"
[ -d "$VLLM_SITE" ] && export PYTHONPATH="$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# the distributions of the pairs "import:dist" whose module Python cannot find (one interpreter for all)
absent() {
    "$PY" - "$@" <<'PYEOF'
import importlib.util, sys
for pair in sys.argv[1:]:
    name, dist = pair.split(":")
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        print(dist)
PYEOF
}
read -r -a missing <<< "$(absent $NEEDED | tr '\n' ' ')"
if [ ${#missing[@]} -gt 0 ]; then
    if ! ls "$WHEELS"/wheels/*.whl >/dev/null 2>&1; then
        echo "gpu_smoke: ${missing[*]} not importable and no wheels in $WHEELS/wheels; run" \
             "'bash benchmarks/gpu_wheels.sh' on a box with the package index and copy $WHEELS here" >&2
        exit 2
    fi
    echo "gpu_smoke: installing ${missing[*]} from $WHEELS/wheels into $SITE" >&2
    extra=()
    if [[ " ${missing[*]} " == *" omegaconf "* ]] && ls "$WHEELS"/wheels/antlr4* >/dev/null 2>&1; then
        extra=(antlr4-python3-runtime)  # omegaconf 2.3's one dependency outside the image
    fi
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --find-links "$WHEELS/wheels" \
        --target "$SITE" "${missing[@]}" ${extra[@]+"${extra[@]}"}
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    for pair in $NEEDED; do
        "$PY" -c "import ${pair%%:*}" || { echo "gpu_smoke: ${pair#*:} still does not import" >&2; exit 2; }
    done
fi

# the packages of the checks that skip without them (megatron_run, deepspeed_ref): installed the same way
# when their wheels were carried, else those checks say they skipped and why
OPTIONAL="megatron.core:megatron-core einops:einops hjson:hjson ninja:ninja cpuinfo:py-cpuinfo pydantic_core:pydantic-core
pydantic:pydantic annotated_types:annotated-types typing_inspection:typing-inspection deepspeed:deepspeed"
optional=()
for dist in $(absent $OPTIONAL); do
    ls "$WHEELS"/wheels/"$(echo "$dist" | tr - _)"-*.whl >/dev/null 2>&1 && optional+=("$dist")
done
if [ ${#optional[@]} -gt 0 ]; then
    echo "gpu_smoke: installing ${optional[*]} from $WHEELS/wheels into $SITE" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --find-links "$WHEELS/wheels" \
        --target "$SITE" "${optional[@]}" || echo "gpu_smoke: could not install ${optional[*]}; their checks skip" >&2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

MODEL=${SMOKE_MODEL:-}
if [ -z "$MODEL" ]; then
    for name in smollm2-135m-instruct tiny-llama; do
        if [ -f "$WHEELS/models/$name/config.json" ]; then MODEL="$PWD/$WHEELS/models/$name"; break; fi
    done
fi
MODEL=${MODEL:-tiny-llama}  # the built-in: found in the switchyard cache, or built (needs the index)

exec "$PY" benchmarks/gpu_smoke.py --device "${SMOKE_DEVICE:-cuda}" --model "$MODEL" \
    --out "${OUT:-runs/gpu_smoke}/gpu_smoke.json" "$@"
