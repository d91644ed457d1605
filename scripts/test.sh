#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
"$XCLS_PY" -m ruff check .
exec "$XCLS_PY" -m pytest -q "$@"
