#!/usr/bin/env bash
# Set up xcls on a fresh Debian/Ubuntu machine (idempotent; re-running is cheap):
#   * the Python environment (scripts/env.sh): an active virtual environment or $PYTHON if
#     given, else the project's .venv, created here (with python3-venv from apt if the system
#     Python lacks it). The .venv sees the system's packages, so an installed torch is used.
#   * torch: kept if already importable (GPU hosts bring their own build); otherwise
#     ${XCLS_TORCH_SPEC:-torch==2.13.0} is installed
#   * xcls itself, editable, with the dev extra (pytest, hypothesis, ruff, tensorboard)
#   * Debian packages: redis-server (bridge tests, Redis cache), the CJK/Hangul font packages
#     listed in scripts/debian-fonts.txt (the glyph dataset), and a C compiler and Python
#     headers where missing (the shards' compiled row update, ams/shard/_kernels.c)
# Set XCLS_SKIP_APT=1 to skip the Debian packages (then install them yourself).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export PIP_DISABLE_PIP_VERSION_CHECK=1

apt_install() {  # Debian packages, as root or through sudo
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing Debian packages: $*"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null
}

if [ -n "${XCLS_VENV:-}" ] && [ ! -x "$XCLS_VENV/bin/python" ]; then
  # Debian's and Ubuntu's python3 refuse 'pip install' (PEP 668) and ship venv's pip in
  # python3-venv: without it, 'python3 -m venv' fails.
  echo "setup: creating $XCLS_VENV"
  if ! python3 -m venv --system-site-packages "$XCLS_VENV" >/dev/null 2>&1; then
    rm -rf "$XCLS_VENV"
    apt_install python3-venv
    python3 -m venv --system-site-packages "$XCLS_VENV"
  fi
fi
PY=$XCLS_PY

if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  "$PY" -m pip install --quiet --root-user-action=ignore "${XCLS_TORCH_SPEC:-torch==2.13.0}"
fi
if [ "${XCLS_SKIP_APT:-0}" != "1" ]; then
  want=(redis-server)
  # a C compiler and the interpreter's headers build the shards' compiled row update
  # (ams/shard/_kernels.c); Debian's own python3 keeps its headers in python3-dev
  command -v cc >/dev/null || want+=(gcc libc6-dev)
  if ! "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(
      os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
      && [ "$("$PY" -c 'import sys; print(sys.base_prefix)')" = /usr ]; then
    want+=(python3-dev)
  fi
  if [ -f scripts/debian-fonts.txt ]; then
    while read -r pkg _; do
      case "$pkg" in ""|\#*) ;; *) want+=("$pkg") ;; esac
    done < scripts/debian-fonts.txt
  fi
  missing=()
  for pkg in "${want[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    apt_install "${missing[@]}"
  fi
fi
"$PY" -m pip install --quiet --root-user-action=ignore -e ".[dev]"
"$PY" -c "import ams.shard._kernels" 2>/dev/null || echo "setup: ams/shard/_kernels.c was not compiled" \
  "(no C compiler or Python headers): the shards update rows in torch, more slowly"

echo "setup: done"
