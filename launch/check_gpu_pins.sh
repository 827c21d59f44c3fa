#!/usr/bin/env bash
# Check that a GPU install's pins (launch/constraints/gpu-<engine>.txt) still resolve together, from the
# wheels' own metadata, for CPython 3.12 on manylinux x86_64: what `bash launch/install.sh gpu <engine>`
# installs, resolved on any box with pip and the package index (no GPU, nothing installed). Run by hand
# after changing a pin, not in CI: pip reads each wheel's metadata, downloading the wheel where the index
# serves no separate metadata file (GBs for torch's CUDA build; the cache makes a second run quick).
#
#   bash launch/check_gpu_pins.sh [vllm|sglang ...]   # both when none is named
#
# Prints the time each resolve took and the versions it chose for the named packages; the full report
# (every package) goes to runs/gpu_pins/<engine>.json. A pin that cannot resolve ends the script non-zero
# with pip's own account of the conflict.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=runs/gpu_pins
mkdir -p "$OUT"
engines=("$@"); [ ${#engines[@]} -eq 0 ] && engines=(vllm sglang)
# pip matches a --platform tag exactly: name every manylinux a glibc 2.35 node (Ubuntu 22.04) runs
target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux1_x86_64
        --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 35); do target+=(--platform "manylinux_2_${n}_x86_64"); done

# DeepSpeed is published as an sdist only (its kernels build on the node), which a cross-platform resolve
# cannot take: its own requirements, read from the sdist, stand in for it
deepspeed_requires() {
    local pins=$1 tmp
    tmp=$(mktemp -d)
    "$PY" -m pip download --quiet --no-deps --no-binary=:all: -c "$pins" -d "$tmp" deepspeed >/dev/null
    "$PY" - "$tmp"/deepspeed-*.tar.gz <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    name = next(n for n in t.getnames() if n.endswith(".egg-info/requires.txt"))
    for line in t.extractfile(name).read().decode().splitlines():
        if line.startswith("["):
            break  # the extras' sections follow the install requirements
        if line.strip():
            print(line.strip())
EOF
    rm -rf "$tmp"
}

for engine in "${engines[@]}"; do
    pins="launch/constraints/gpu-$engine.txt"
    [ -f "$pins" ] || { echo "check_gpu_pins: no $pins; choose vllm or sglang" >&2; exit 2; }
    mapfile -t ds < <(deepspeed_requires "$pins")
    # the project's own requirements come from pyproject.toml, read the way pip reads them
    start=$(date +%s)
    "$PY" -m pip install --dry-run --ignore-installed --quiet "${target[@]}" -c "$pins" \
        --report "$OUT/$engine.json" "$engine" torch megatron-core accelerate peft "${ds[@]}" ".[gpu]"
    took=$(( $(date +%s) - start ))
    "$PY" - "$OUT/$engine.json" "$pins" "$took" <<'EOF'
import json, re, sys
report, pins, took = sys.argv[1], sys.argv[2], sys.argv[3]
chosen = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
          for i in json.load(open(report))["install"]}
named = [re.split(r"[=<>!~ ]", l.strip())[0].lower() for l in open(pins) if l.strip() and not l.startswith("#")]
line = ", ".join(f"{n} {chosen.get(n, '(sdist, not resolved here)')}" for n in named)
print(f"{pins}: resolved in {took} s, {len(chosen)} packages: {line}")
EOF
done
