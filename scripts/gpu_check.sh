#!/usr/bin/env bash
# The GPU checks in one go (under 10 minutes), for a lent GPU machine that cannot fetch anything.
#
#   here:  bash scripts/gpu_check.sh --fetch   # wheels the GPU image lacks, into .whl/ (once)
#   there: bash scripts/gpu_check.sh           # with .whl carried; writes $OUT/gpu_check.json
#          (the device tool: run(carry=[".whl"], command="bash scripts/gpu_check.sh"))
#
# The GPU image's python3 has torch (CUDA), transformers, prometheus-client, psutil, msgpack,
# jinja2 and nvidia-ml-py; the wheels add what vconsole needs beside them. The project installs
# without its dependencies (pip --no-deps --no-index), so nothing is downloaded there.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="pyzmq textual fastapi starlette uvicorn pydantic pydantic-core annotated-types
typing-inspection openai distro jiter sniffio anyio h11 httpx httpcore platformdirs
textual-plotext plotext mdit-py-plugins linkify-it-py uc-micro-py"
if [[ "${1:-}" == "--fetch" ]]; then
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    for w in $WHEELS; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "$w" || \
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "$w"
    done
    du -sh .whl
    exit 0
fi
OUT="${OUT:-.}"
if [[ -d .whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/vc . \
    || python3 -m pip install -q --no-index --no-deps --no-build-isolation --user .
export PYTHONPATH=/tmp/vc:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if command -v nsys >/dev/null || ls /opt/nvidia/nsight-systems/*/bin/nsys >/dev/null 2>&1; then
    echo "nsys: present (the NVTX check records under nsys profile)" >&2
else
    echo "nsys: not installed (the NVTX check runs the ranges and capture range without it)" >&2
fi
python3 scripts/gpu_check.py --out "$OUT/gpu_check.json" --budget-s "${BUDGET_S:-500}"
