#!/usr/bin/env bash
# Build, on a machine with internet, what scripts/gpu_checks.sh installs on a GPU host without
# it: the wheelhouse .whl/ (ignored by git; the device tool carries it when its carry list
# names .whl). The GPU host's Python 3.12 has torch but lacks lmdb and redis and has other
# grpcio/protobuf versions than the generated stubs (ams/api) need, so this downloads the
# CPython 3.12 x86_64 wheels of the versions this checkout's environment runs its tests with:
#   grpcio, grpcio-health-checking, protobuf, lmdb, redis
# and packs the test fonts (tests/conftest.py SMALL_FONTS, from /usr/share/fonts: the GPU
# host has none) as .whl/xcls-test-fonts.tar.xz. faiss-cpu is left out (30 MB; the GPU
# checks build exact graphs only). About 27 MB in all.
#
# Usage: bash scripts/gpu_wheels.sh [--dry-run] [DIR]     (DIR: default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^# Usage/p' "$0" | sed 's/^# \{0,1\}//'; }
dry=0
out=.whl
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry=1 ;;
    -*) echo "gpu_wheels: unknown option $arg" >&2; usage >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
source scripts/env.sh

version() { "$XCLS_PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
packages=()
for name in grpcio grpcio-health-checking protobuf lmdb redis; do
  packages+=("$name==$(version "$name")")
done
# manylinux tags newest first: pip matches each exactly
platforms=()
for tag in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_x86_64")
done
download=("$XCLS_PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12
          --implementation cp "${platforms[@]}" -d "$out" "${packages[@]}")
fonts=$("$XCLS_PY" -c "
from tests.conftest import SMALL_FONTS
from workers.data.fonts import find_fonts
found = {f.path.name: f.path for f in find_fonts()}
missing = [n for n in SMALL_FONTS if n not in found]
if missing:
    raise SystemExit(f'gpu_wheels: fonts {missing} are not installed: run bash scripts/setup.sh')
print(' '.join(str(found[n]) for n in SMALL_FONTS))")
pack=(tar -cJf "$out/xcls-test-fonts.tar.xz" --absolute-names $fonts)

if [ "$dry" = 1 ]; then
  printf '%q ' "${download[@]}"; echo
  printf '%q ' "${pack[@]}"; echo
  exit 0
fi
mkdir -p "$out"
rm -f "$out"/*.whl
"${download[@]}"
"${pack[@]}"
du -sh "$out"
