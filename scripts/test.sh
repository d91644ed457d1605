#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest
# (after ours, so they win: "-n 0" runs every test in this one process, "-k NAME" picks tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
"$XCLS_PY" -m ruff check .
# Two pytest workers (pytest-xdist): one test at a time leaves a core idle while it waits on
# the processes it started (benchmarks/RESULTS.md, "Test suite").
exec "$XCLS_PY" -m pytest -q -n 2 "$@"
