#!/usr/bin/env bash
# On the GPU machine: join the slim vLLM wheel's parts (benchmarks/vllm_wheels.sh made them; one device call
# carried each) and install it with the wheels of benchmarks/vllm_deps.txt, all --no-deps, into
# benchmarks/.gpu_wheels/vllm/site-cpXY (git-ignored: a warm machine keeps it for the next call;
# benchmarks/gpu_smoke.sh puts it on PYTHONPATH). The image's own packages are not touched. Then imports
# vLLM and the project's vLLM engine modules and checks that vLLM sees the GPU and its kernels load.
#
#   bash benchmarks/vllm_device_install.sh [--check-only]      # --check-only: a here run, no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=benchmarks/.gpu_wheels/vllm
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
SITE="$PWD/$DEST/site-$TAG"
GPU=1; [ "${1:-}" = "--check-only" ] && GPU=0

[ -f "$DEST/SHA256" ] || { echo "vllm_device_install: no $DEST/SHA256: run benchmarks/vllm_wheels.sh here and carry $DEST/part-NN and $DEST/deps" >&2; exit 2; }
read -r sum wheel < "$DEST/SHA256"
parts=("$DEST"/part-*/"$wheel".part-*)
[ -e "${parts[0]}" ] || { echo "vllm_device_install: no parts of $wheel under $DEST/part-*/ (carry each in its own call)" >&2; exit 2; }
cat "${parts[@]}" > "$DEST/$wheel"
got=$(sha256sum "$DEST/$wheel" | cut -d' ' -f1)
if [ "$got" != "$sum" ]; then
    echo "vllm_device_install: $wheel joined from ${#parts[@]} parts has sha256 $got, expected $sum: a part is" \
         "missing or stale; carry every $DEST/part-NN of the same benchmarks/vllm_wheels.sh run" >&2
    exit 2
fi
ls "$DEST"/deps/*.whl >/dev/null 2>&1 || { echo "vllm_device_install: no wheels in $DEST/deps: carry it with the last part" >&2; exit 2; }
rm -rf "$SITE"
"$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --target "$SITE" \
    "$DEST/$wheel" "$DEST"/deps/*.whl
rm -f "$DEST/$wheel"
echo "vllm_device_install: $wheel (${#parts[@]} parts) and $(ls "$DEST"/deps/*.whl | wc -l) dependency wheels in $SITE"

PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" VLLM_INSTALL_GPU=$GPU "$PY" - <<'PY'
import importlib, os, sys, time
t0 = time.perf_counter()
import torch, vllm
from vllm import SamplingParams  # noqa: F401
for m in ("engines.inference.vllm", "engines.inference.vllm_inproc", "engines.inference.vllm_worker",
          "vllm.engine.arg_utils", "vllm.v1.engine.async_llm", "vllm.v1.engine.llm_engine", "vllm.lora.request",
          "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen2",
          "vllm.v1.attention.backends.flash_attn"):
    importlib.import_module(m)
print(f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}: engine modules import "
      f"({time.perf_counter() - t0:.1f} s), torch {torch.__version__}")
if os.environ["VLLM_INSTALL_GPU"] == "0":  # no GPU here: the kernels load as far as the CUDA driver
    try:
        import vllm._C_stable_libtorch  # noqa: F401
        print("vllm._C_stable_libtorch loads")
    except ImportError as e:
        if "libcuda" not in str(e):
            raise
        print(f"vllm._C_stable_libtorch stops at the CUDA driver, as it must without a GPU: {e}")
else:
    from vllm.platforms import current_platform
    from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON
    current_platform.import_kernels()
    import vllm._C_stable_libtorch  # noqa: F401  (the cache, norm and activation kernels)
    print(f"platform {type(current_platform).__name__}, {torch.cuda.get_device_name()}, "
          f"capability {torch.cuda.get_device_capability()}; FA3 {FA3_AVAILABLE or FA3_UNAVAILABLE_REASON}")
    if not FA3_AVAILABLE:
        sys.exit("FlashAttention 3 does not load: vLLM would fall back to a backend this wheel does not hold")
PY
