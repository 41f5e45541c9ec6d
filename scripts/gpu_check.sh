#!/usr/bin/env bash
# One device call for the kernels: install tierkv (no network there), run the GPU tests of the
# kernels, then benchmarks/bench_kernels.py. Everything lands in $OUT (log, JSON, PNG).
# Usage (device tool): bash scripts/gpu_check.sh [extra bench_kernels.py args, e.g. --sweep]
# GPU_TESTS overrides which tests run (default: the kernels' GPU tests; "all" = pytest -m gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tierkv-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
{
  echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  targets=${GPU_TESTS:-tests/test_kernels_gpu.py}
  [ "$targets" = all ] && targets=""
  echo "== pytest -m gpu $targets"
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 $targets
  echo "== pytest exit $?"
  echo "== bench_kernels $*"
  timeout 420 python3 benchmarks/bench_kernels.py --out "$OUT" "$@"
  echo "== bench exit $?"
} 2>&1 | tee "$LOG"
