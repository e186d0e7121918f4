#!/usr/bin/env bash
# Set up (idempotent), lint (ruff check, ruff format --check, mypy on the core packages),
# run the whole test suite (slow tests included) and, beside it, the vllm backend's tests
# with the real engine in their own environment (.venv-vllm, ~4 min to set up the first
# time; set up and then tested in the background from before the lint on, while the lint
# and pytest run; their output follows pytest's; CONSOLIDATE_SKIP_VLLM=1 skips them).
#
#   bash scripts/test.sh                 # everything (what CI runs)
#   bash scripts/test.sh --fast          # the fast lane: lint, then pytest -m "not slow";
#                                        # no vllm environment
#   bash scripts/test.sh tests/test_x.py # other arguments go to pytest
#
# pytest runs in CONSOLIDATE_TEST_WORKERS processes (pytest-xdist, default 2; 1 runs it in
# one process), each with one OpenMP thread (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup.sh
vllm=0
if [ "$fast" = 0 ] && [ "${CONSOLIDATE_SKIP_VLLM:-0}" != 1 ]; then
  # .venv-vllm is set up (pip: mostly download and unpacking), then its tests run, while
  # the lint (a cold mypy takes ~40 s) and pytest run: they share the machine's CPUs
  vllm=1
  vllm_log=$(mktemp)
  # a temp folder of its own: a pytest session that starts in pytest-of-$USER takes away
  # the access that the suite's PostgreSQL server (another user, when run as root) needs
  vllm_tmp=$(mktemp -d)
  set -m # its own process group: stopped with pip's processes if this script stops first
  {
    bash scripts/setup_vllm.sh || exit 90
    .venv-vllm/bin/python -m pytest -q --basetemp "$vllm_tmp/pytest" tests/llm/test_vllm.py
  } > "$vllm_log" 2>&1 &
  vllm_pid=$!
  set +m
  trap 'kill -- -"$vllm_pid" 2>/dev/null || true; rm -rf "$vllm_log" "$vllm_tmp"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
fi
# the lint runs while the vllm set-up (started above) goes on
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
workers=${CONSOLIDATE_TEST_WORKERS:-2}
par=()
if [ "$workers" != 1 ]; then
  par=(-n "$workers" --dist worksteal)
fi
if [ "$fast" = 1 ]; then
  .venv/bin/python -m pytest -q ${par[@]+"${par[@]}"} -m "not slow" "$@"
  exit 0
fi
# a failure here or in the lint exits (set -e), and the EXIT trap stops the vllm set-up or
# tests; a later run redoes what is missing
.venv/bin/python -m pytest -q ${par[@]+"${par[@]}"} "$@"
if [ "$vllm" = 1 ]; then
  vrc=0
  wait "$vllm_pid" || vrc=$?
  echo "--- scripts/setup_vllm.sh, then pytest tests/llm/test_vllm.py in .venv-vllm:"
  cat "$vllm_log"
  if [ "$vrc" = 90 ]; then
    echo "test.sh: scripts/setup_vllm.sh failed, see above" >&2
    exit 1
  elif [ "$vrc" != 0 ]; then
    echo "test.sh: the vllm tests failed (pytest exit $vrc), see above" >&2
    exit "$vrc"
  fi
fi
