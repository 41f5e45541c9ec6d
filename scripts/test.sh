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

set +e
$PY -m pytest -m "not gpu" --durations=25 "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: a suite that ran nothing must fail, not pass silently.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi
exit "$rc"
