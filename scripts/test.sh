#!/usr/bin/env bash
# Set up (idempotent), lint (ruff check, ruff format --check, mypy on the core packages),
# run the whole test suite (slow tests included), then the vllm backend's tests with the
# real engine in their own environment (.venv-vllm, ~4 min to set up the first time;
# CONSOLIDATE_SKIP_VLLM=1 skips them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
if [ "${CONSOLIDATE_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup_vllm.sh
  .venv-vllm/bin/python -m pytest -q tests/test_vllm.py
fi
