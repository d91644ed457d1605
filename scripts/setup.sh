#!/usr/bin/env bash
# Set up xcls on a fresh Debian/Ubuntu machine (idempotent; re-running is cheap):
#   * torch: kept if already importable (GPU hosts bring their own build); otherwise
#     ${XCLS_TORCH_SPEC:-torch==2.13.0} is installed
#   * xcls itself, editable, with the dev extra (pytest, hypothesis, ruff, tensorboard)
#   * Debian packages: redis-server (bridge tests, Redis cache) and the CJK/Hangul font packages
#     listed in scripts/debian-fonts.txt (the glyph dataset)
# Set XCLS_SKIP_APT=1 to skip the Debian packages (then install them yourself).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  "$PY" -m pip install --quiet --root-user-action=ignore "${XCLS_TORCH_SPEC:-torch==2.13.0}"
fi
"$PY" -m pip install --quiet --root-user-action=ignore -e ".[dev]"

if [ "${XCLS_SKIP_APT:-0}" != "1" ]; then
  want=(redis-server)
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
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "setup: installing Debian packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
fi
echo "setup: done"
