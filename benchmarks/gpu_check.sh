#!/usr/bin/env bash
# GPU check: build the CUDA library, check every install backend against the torch reference on
# the GPU, and measure install throughput per window size (see benchmarks/gpu_check.py).
#
#   bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --budget-s 200 --skip-bench]
#
# Needs a Python whose torch has CUDA ($PYTHON, else the first of .venv-gpu/bin/python,
# .venv/bin/python, python3, python that has one); it is not installed here (the machine may be
# offline). A venv .venv-gpu (--system-site-packages, so it sees that torch) gets an editable
# install with BSR_BUILD_CUDA=1. Without pip/setuptools or with an offline build failing, the
# library is compiled with nvcc directly (same flags as setup.py); without nvcc, a
# bsr_kernels/lib/libbsr_cuda.so brought along (e.g. carried from a build machine) is used.
# The library built with CUDA 13 needs an NVIDIA driver >= 580. Under 5 minutes on an H200.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
LIB=$ROOT/bsr_kernels/lib/libbsr_cuda.so
log() { echo "[gpu_check] $*"; }
t0=$SECONDS

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
        --format=csv,noheader || true
else
    log "nvidia-smi not found"
fi

has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

BASE=""
for cand in "${PYTHON:-}" "$ROOT/.venv-gpu/bin/python" "$ROOT/.venv/bin/python" python3 python; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    if has_cuda_torch "$cand"; then BASE=$cand; break; fi
done
if [ -z "$BASE" ]; then
    log "no Python with a CUDA-enabled torch found (tried \$PYTHON, .venv-gpu, .venv, python3, python):"
    for cand in python3 python "$ROOT/.venv/bin/python"; do
        command -v "$cand" >/dev/null 2>&1 || continue
        "$cand" -c 'import torch; print(" ", torch.__version__, "cuda", torch.version.cuda,
              "is_available", torch.cuda.is_available())' 2>&1 | sed "s|^|  $cand: |"
    done
    log "install a CUDA build of torch (pip install torch --index-url <PyTorch CUDA wheel index>) and rerun"
    exit 2
fi
log "python with CUDA torch: $BASE ($("$BASE" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)'))"

PY=$BASE
VENV=$ROOT/.venv-gpu
if [ "$BASE" != "$VENV/bin/python" ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        "$BASE" -m venv --system-site-packages "$VENV" >/dev/null 2>&1 || log "could not create $VENV"
    fi
    if [ -x "$VENV/bin/python" ] && has_cuda_torch "$VENV/bin/python"; then
        PY=$VENV/bin/python
    else
        log "$VENV does not see the CUDA torch (base is itself a venv?); using $BASE without a venv"
    fi
fi

# -- build the library --------------------------------------------------------------------------
export BSR_BUILD_CUDA=1
built=0
if [ "$PY" = "$VENV/bin/python" ] && "$PY" -m pip --version >/dev/null 2>&1 \
        && "$PY" -c 'import setuptools' >/dev/null 2>&1; then
    PIPLOG=${TMPDIR:-/tmp}/bsr_gpu_check_pip.log
    log "pip install -e . --no-deps (BSR_BUILD_CUDA=1, no build isolation: the machine may be offline)"
    if "$PY" -m pip install -v -e . --no-deps --no-build-isolation >"$PIPLOG" 2>&1; then
        built=1
    else
        log "editable install failed; last lines of $PIPLOG:"
        tail -n 15 "$PIPLOG"
    fi
    grep -E "bsr: " "$PIPLOG" | sed 's/^ *//' || true
fi
if [ "$built" = 0 ] || [ ! -f "$LIB" ]; then
    NVCC=$(command -v nvcc || true)
    [ -z "$NVCC" ] && [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] && NVCC=$CUDA_HOME/bin/nvcc
    [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
    if [ -n "$NVCC" ]; then
        log "compiling with $NVCC directly"
        mkdir -p "$ROOT/bsr_kernels/lib"
        "$NVCC" -O3 -Xcompiler -fPIC -shared -gencode arch=compute_90,code=sm_90 \
            -gencode arch=compute_90,code=compute_90 -o "$LIB" "$ROOT/csrc/bsr_install.cu" \
            || log "nvcc failed"
    elif [ -f "$LIB" ]; then
        log "no nvcc here: using the library brought along, $LIB"
    else
        log "no nvcc and no prebuilt $LIB: the CUDA backend will be reported unavailable"
    fi
fi
[ -f "$LIB" ] && log "library: $LIB ($(stat -c %s "$LIB") bytes)"
command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -n 2
log "setup took $((SECONDS - t0)) s"

# -- run -------------------------------------------------------------------------------------------
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
timeout 285 "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
rc=$?
[ "$rc" = 124 ] && log "gpu_check.py ran past 285 s and was stopped; the report keeps the rows it finished"
# on a lent device machine, hand the newest report and the records back through $OUT (append the
# record lines to benchmarks/results/gpu_check.jsonl of the checkout, then python -m bsr_harness.report)
report=$(ls -t "${TMPDIR:-/tmp}"/bsr_gpu_check_*.txt 2>/dev/null | head -n 1)
records=$ROOT/benchmarks/results/gpu_check.jsonl
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    for f in "$report" "$records"; do [ -n "$f" ] && [ -f "$f" ] && cp "$f" "$OUT"/ && log "copied $f to \$OUT"; done
fi
log "exit $rc after $((SECONDS - t0)) s"
exit "$rc"
