#!/usr/bin/env bash
# The README's test command: installs what the tests need, then runs the whole CPU suite.
# Services (redis-server, SeaweedFS) are installed here and started by pytest fixtures on free
# loopback ports. Extra arguments go to pytest (e.g. `bash scripts/test.sh -k index`).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
EXTRAS=test bash scripts/install.sh

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
  fi
fi

# The whole suite (no arguments) ends with the vLLM connector's tests, whose venv takes ~2 min to
# make on a fresh machine (mostly downloads): make it in the background while the other tests run.
# Their fixture runs scripts/vllm_env.sh again, which waits for this one and then reuses its venv
# (or, had this one failed, makes it itself and reports why).
if [ "$#" -eq 0 ]; then
  bash scripts/vllm_env.sh >"${TMPDIR:-/tmp}/tierkv-vllm-env.log" 2>&1 &
  prefetch=$!
  trap 'kill "$prefetch" 2>/dev/null || true' EXIT
fi

set +e
$PY -m pytest -m "not gpu" --durations=25 "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: a suite that ran nothing must fail, not pass silently.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi
exit "$rc"
