# Sourced by setup.sh, demo.sh and test.sh: the Python environment they use.
#   * an active virtual environment ($VIRTUAL_ENV), else
#   * $PYTHON if set (a Python you manage yourself), else
#   * the project's own .venv (setup.sh creates it), also put first on PATH so that
#     'python3' in every process they start is that environment's.
# Sets XCLS_PY (the interpreter) and, for the project .venv, XCLS_VENV. The scripts run
# everything through "$XCLS_PY" ("$XCLS_PY" -m xcls, never a bare 'xcls' from PATH), so each
# of the three ways works whatever PATH holds.
if [ -n "${VIRTUAL_ENV:-}" ]; then
  XCLS_PY="$VIRTUAL_ENV/bin/python"
elif [ -n "${PYTHON:-}" ]; then
  XCLS_PY="$PYTHON"
else
  XCLS_VENV="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv"
  XCLS_PY="$XCLS_VENV/bin/python"
  export PATH="$XCLS_VENV/bin:$PATH"
fi
