#!/usr/bin/env bash
# One device call: install tierkv on the GPU machine (no network there: the wheels in .whl/ from
# ../shared/tools/device-wheels.sh, carried), then run the named parts in order, each under its
# own time limit, so one failure never costs the others. Everything lands in $OUT (log, JSON, PNG).
#   parts: tests (pytest -m gpu, or the files in GPU_TESTS; all 175 took ~430 s at 995d4e8, over two calls; TESTS_LIMIT s allowed, 480), kernels, throughput, latency,
#          long_context, serving, tiers (bench_tiers: disk, and Redis/S3 when .devsvc/ is carried),
#          families (bench_families: MoE / sliding-window shapes, decode and a 100K L2 hit), moe, mla,
#          linear (bench_linear: the small-M linear against cuBLAS)
# The device has no redis-server or SeaweedFS: scripts/device_services.sh packs them into .devsvc/
# (carry it, with the .whl/ files of boto3, botocore, s3transfer, jmespath and redis).
# Usage (device tool, carry [".whl"]): TIERKV_COMMIT=<sha sent> bash scripts/gpu_check.sh tests kernels throughput
# (the device's copy of .git can lag the tree it runs: without TIERKV_COMMIT the JSONs may name an older commit)
# Extra arguments per benchmark: KERNELS_ARGS, THROUGHPUT_ARGS, LATENCY_ARGS, LONG_ARGS, SERVING_ARGS, LINEAR_ARGS.
# throughput with its HF peer on all 256 prompts takes ~6 min: give it a call of its own.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tierkv-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"

install() {
  echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}

services() {  # unpack the carried redis-server, redis-cli and weed onto PATH; false if not carried
  [ -f .devsvc/redis.tar.xz ] && [ -f .devsvc/weed.xz ] || return 1
  mkdir -p /tmp/svc/real /tmp/svc/bin
  tar -C /tmp/svc/real -xJf .devsvc/redis.tar.xz && xz -dc .devsvc/weed.xz > /tmp/svc/bin/weed && chmod +x /tmp/svc/bin/weed
  for b in redis-server redis-cli; do  # their libraries for them alone: Python keeps the system's
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/svc/real/lib exec /tmp/svc/real/bin/%s "$@"\n' "$b" > /tmp/svc/bin/$b
    chmod +x /tmp/svc/bin/$b
  done
  export PATH=/tmp/svc/bin:$PATH
  redis-server --version && weed version
}

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"
  echo "== $name exit $? after $((SECONDS - t0)) s"
}

{
  install
  for p in "$@"; do
    case $p in
      # the files that hold GPU tests (the others may import what the device lacks: zmq, kubernetes_validate)
      tests) part tests ${TESTS_LIMIT:-480} python3 -m pytest -m gpu -q -p no:cacheprovider --durations=10 \
               ${GPU_TESTS:-$(grep -l "pytest.mark.gpu" tests/test_*.py)} ;;
      kernels) part kernels 300 python3 benchmarks/bench_kernels.py --out "$OUT" ${KERNELS_ARGS:-} ;;
      throughput) part throughput 540 python3 benchmarks/bench_throughput.py --out "$OUT" ${THROUGHPUT_ARGS:-} ;;
      latency) part latency 240 python3 benchmarks/bench_latency.py --out "$OUT" ${LATENCY_ARGS:-} ;;
      long_context) part long_context 420 python3 benchmarks/bench_long_context.py --out "$OUT" ${LONG_ARGS:-} ;;
      serving) part serving 540 python3 benchmarks/bench_serving.py --out "$OUT" ${SERVING_ARGS:-} ;;
      families) part families 540 python3 benchmarks/bench_families.py --out "$OUT" ${FAMILIES_ARGS:---hit} ;;
      moe) part moe 240 python3 benchmarks/bench_moe.py --out "$OUT" ${MOE_ARGS:-} ;;
      linear) part linear 180 python3 benchmarks/bench_linear.py --out "$OUT" ${LINEAR_ARGS:-} ;;
      mla) part mla 240 python3 benchmarks/bench_mla_decode.py --out "$OUT" ${MLA_ARGS:-} ;;
      tiers) if services; then part tiers 420 python3 benchmarks/bench_tiers.py --out "$OUT" ${TIERS_ARGS:-}
             else part tiers 420 python3 benchmarks/bench_tiers.py --no-services --out "$OUT" ${TIERS_ARGS:-}; fi ;;
      *) echo "unknown part $p" ;;
    esac
  done
  echo "== done $(date -u)"
} 2>&1 | tee "$LOG"
