#!/usr/bin/env bash
# One device call: install tierkv on the GPU machine (no network there: the wheels in .whl/ from
# ../shared/tools/device-wheels.sh, carried), then run the named parts in order, each under its
# own time limit, so one failure never costs the others. Everything lands in $OUT (log, JSON, PNG).
#   parts: tests (pytest -m gpu, or the files in GPU_TESTS; all 281 took 146 s with "-n 8 --dist loadfile" at 4c5483f on a warm H100, a first cold run over 262 s;
#          at fcee72c "-n 8" failed 9 tests that passed alone: the LLMs sizing L1 by default (80% of the free memory) and the 128K tests ran out of GPU memory beside each other, so use -n 4; TESTS_LIMIT s allowed, 480), kernels, throughput, latency,
#          gemv (bench_gemv --sweep: batch-1 linears vs cuBLAS, ~2 min), steps (bench_step_graphs: a step's launch, eager and as a graph),
#          planes (bench_planes: copy_planes vs memcpy, and a move over PCIe on 4..all programs beside a decode step's linears),
#          long_context, serving, admission (bench_admission: the host's ms to admit an 8K-token L2 hit, ~30 s),
#          rounds (bench_rounds: hit rounds against their bound), rounds_ab (bench_rounds with,
#          without and again with the change in AB_PATCH, ~3 x 130 s), tiers (bench_tiers: disk, and Redis/S3 when .devsvc/ is carried),
#          families (bench_families: MoE / sliding-window shapes, decode and a 100K L2 hit), moe, mla,
#          mixed_step (bench_mixed_step: a mixed step's attention as the engine's graphs run it, ~40 s),
#          decode_long (sweep_decode_long --no-grid: 1x128K-class decode vs SDPA, PDL and stealing variants),
#          fleet (bench_routers --gpu: replicas on one GPU behind vllm-router; carry .fleet from
#          scripts/device_fleet.sh, which holds redis and every wheel it needs; FLEET_LIMIT s, 540)
# The device has no redis-server or SeaweedFS: scripts/device_services.sh packs them into .devsvc/
# (carry it, with the .whl/ files of boto3, botocore, s3transfer, jmespath and redis).
# Usage (device tool, carry [".whl"]): TIERKV_COMMIT=<sha sent> bash scripts/gpu_check.sh tests kernels throughput
# (the device's copy of .git can lag the tree it runs: without TIERKV_COMMIT the JSONs may name an older commit)
# Extra arguments per part: TESTS_ARGS (e.g. "-n 6 --dist loadfile" with pytest-xdist's wheels in .whl/), KERNELS_ARGS, THROUGHPUT_ARGS, LATENCY_ARGS, GEMV_ARGS, STEPS_ARGS, PLANES_ARGS, LONG_ARGS, DECODE_LONG_ARGS, MIXED_STEP_ARGS, SERVING_ARGS, ADMISSION_ARGS, ROUNDS_ARGS, FLEET_ARGS.
# throughput with its HF peer on all 256 prompts takes ~6 min: give it a call of its own.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tierkv-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"

install() {
  echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  # the carried wheels, .whl/ and .fleet/ (scripts/device_fleet.sh), each file name once
  local wheels
  wheels=$(ls .whl/*.whl .fleet/*.whl 2>/dev/null | awk -F/ '!seen[$NF]++')
  if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}

redis_up() {  # unpack a carried redis-server and redis-cli (.devsvc/ or .fleet/) onto PATH; false if none
  local tarball
  tarball=$(ls .devsvc/redis.tar.xz .fleet/redis.tar.xz 2>/dev/null | head -1)
  [ -n "$tarball" ] || return 1
  mkdir -p /tmp/svc/real /tmp/svc/bin
  tar -C /tmp/svc/real -xJf "$tarball" || return 1
  for b in redis-server redis-cli; do  # their libraries for them alone: Python keeps the system's
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/svc/real/lib exec /tmp/svc/real/bin/%s "$@"\n' "$b" > /tmp/svc/bin/$b
    chmod +x /tmp/svc/bin/$b
  done
  export PATH=/tmp/svc/bin:$PATH
  redis-server --version
}

services() {  # redis and weed (bench_tiers), unpacked onto PATH; false if either is not carried
  [ -f .devsvc/weed.xz ] && redis_up || return 1
  xz -dc .devsvc/weed.xz > /tmp/svc/bin/weed && chmod +x /tmp/svc/bin/weed
  weed version
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
      # -v: each test's outcome is logged as it ends, so a run cut off by its time limit still names
      # the failures so far (with -q, xdist prints dots; a8622f3's cut-off run named none)
      tests) part tests ${TESTS_LIMIT:-480} python3 -m pytest -m gpu -v -p no:cacheprovider --durations=10 ${TESTS_ARGS:-} \
               ${GPU_TESTS:-$(grep -l "pytest.mark.gpu" tests/test_*.py)} ;;
      kernels) part kernels 300 python3 benchmarks/bench_kernels.py --out "$OUT" ${KERNELS_ARGS:-} ;;
      throughput) part throughput 540 python3 benchmarks/bench_throughput.py --out "$OUT" ${THROUGHPUT_ARGS:-} ;;
      latency) part latency 240 python3 benchmarks/bench_latency.py --out "$OUT" ${LATENCY_ARGS:-} ;;
      gemv) part gemv 240 python3 benchmarks/bench_gemv.py --out "$OUT" ${GEMV_ARGS:---sweep} ;;
      steps) part steps 240 python3 benchmarks/bench_step_graphs.py --out "$OUT" ${STEPS_ARGS:-} ;;
      planes) part planes 300 python3 benchmarks/bench_planes.py --out "$OUT" ${PLANES_ARGS:-} ;;
      long_context) part long_context 420 python3 benchmarks/bench_long_context.py --out "$OUT" ${LONG_ARGS:-} ;;
      serving) part serving 540 python3 benchmarks/bench_serving.py --out "$OUT" ${SERVING_ARGS:-} ;;
      admission) part admission 180 python3 benchmarks/bench_admission.py --out "$OUT" ${ADMISSION_ARGS:-} ;;
      rounds) part rounds 540 python3 benchmarks/bench_rounds.py --out "$OUT" ${ROUNDS_ARGS:---profile-seconds 2} ;;
      # the same bench_rounds with the change in AB_PATCH (a `git diff base branch` file, carried: the
      # tree sent is the branch), without it (reverted here), and with it again, one after the other on
      # one machine, so its drift falls on both sides; each run in OUT/ab-<n>-<with|without>
      rounds_ab) if [ -f "${AB_PATCH:-}" ]; then
                   n=0
                   for side in ${AB_SIDES:-with without with}; do  # AB_SIDES="with without": one pair, when time is short
                     n=$((n + 1))
                     if [ $n -gt 1 ]; then
                       if [ $side = without ]; then patch -s -R -p1 < "$AB_PATCH"; else patch -s -p1 < "$AB_PATCH"; fi || break
                     fi
                     mkdir -p "$OUT/ab-$n-$side"
                     part "rounds_ab $n ($side)" ${AB_LIMIT:-200} python3 benchmarks/bench_rounds.py --out "$OUT/ab-$n-$side" \
                       --configs l1+l2 ${ROUNDS_ARGS:-}
                   done
                 else echo "rounds_ab: AB_PATCH names no file (git diff main BRANCH > ab.patch here, then AB_PATCH=ab.patch)"; fi ;;
      families) part families 540 python3 benchmarks/bench_families.py --out "$OUT" ${FAMILIES_ARGS:---hit} ;;
      moe) part moe 240 python3 benchmarks/bench_moe.py --out "$OUT" ${MOE_ARGS:-} ;;
      mla) part mla 240 python3 benchmarks/bench_mla_decode.py --out "$OUT" ${MLA_ARGS:-} ;;
      mixed_step) part mixed_step 240 python3 benchmarks/bench_mixed_step.py --out "$OUT" ${MIXED_STEP_ARGS:-} ;;
      decode_long) part decode_long 300 python3 benchmarks/sweep_decode_long.py --out "$OUT" ${DECODE_LONG_ARGS:---no-grid} ;;
      # replicas of a Qwen3-0.6B-shaped model behind vllm-router, kv_aware vs round_robin (carry .fleet)
      fleet) if redis_up; then part fleet ${FLEET_LIMIT:-540} python3 benchmarks/bench_routers.py --out "$OUT" ${FLEET_ARGS:---gpu --budget-s 150}
             else echo "fleet: no redis-server carried: bash scripts/device_fleet.sh here, carry [\".fleet\"]"; fi ;;
      tiers) if services; then part tiers 420 python3 benchmarks/bench_tiers.py --out "$OUT" ${TIERS_ARGS:-}
             else part tiers 420 python3 benchmarks/bench_tiers.py --no-services --out "$OUT" ${TIERS_ARGS:-}; fi ;;
      *) echo "unknown part $p" ;;
    esac
  done
  echo "== done $(date -u)"
} 2>&1 | tee "$LOG"
