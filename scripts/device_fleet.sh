#!/usr/bin/env bash
# Pack what bench_routers' fleet needs on the GPU machine (no network, no redis-server, no
# vllm-router there) into .fleet/ (git-ignored), to carry alone: carry [".fleet"], ~30 MB with
# the working tree well under the 64 MiB a call may take. SeaweedFS and the S3 client stay out.
#   .fleet/redis.tar.xz   redis-server + redis-cli (scripts/device_services.sh redis)
#   .fleet/*.whl          vllm-router 0.1.17 and what its launcher imports (setproctitle, orjson),
#                         pyzmq (--kv-events-config), and the server's and the redis client's wheels
#                         (copied from .whl/, ../shared/tools/device-wheels.sh's, checked there)
# gpu_check.sh installs .fleet/*.whl and unpacks its redis for the `fleet` part. Run here, from the
# project root: bash scripts/device_fleet.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUTER=vllm-router==0.1.17  # the version tests/test_routers.py checks against
mkdir -p .fleet
rm -f .fleet/*.whl
DEVSVC=.fleet bash scripts/device_services.sh redis
server=(redis fastapi starlette pydantic pydantic_core annotated_types typing_inspection opentelemetry_api uvicorn)
ls .whl/fastapi-*.whl >/dev/null 2>&1 || ../shared/tools/device-wheels.sh
for name in "${server[@]}"; do cp .whl/"$name"-[0-9]*.whl .fleet/; done
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
# the router's wheel is cp38-abi3: pip takes it for 3.12 (the device's Python)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .fleet "$ROUTER" setproctitle orjson pyzmq
du -sh .fleet
ls .fleet
echo 'carry: [".fleet"]; then: bash scripts/gpu_check.sh fleet (see benchmarks/bench_routers.py)'
