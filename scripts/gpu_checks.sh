#!/usr/bin/env bash
# The checks that need a GPU: the CUDA tests, then the benchmarks whose rows RESULTS.md shows
# for the GPU. A call runs the steps that fit in its budget (8 minutes unless told) and names
# the rest; the whole set takes about 15 minutes on one H100/H200 host, so it is two calls:
# creating the 20 GB tables of 10M classes (45-70 s each, three placements) and the 25.6 GB
# table of 100M (160 s) takes most of it.
#
# Carry. The GPU host has no internet and no fonts, and its Python 3.12 has torch but lacks
# lmdb and redis and has other grpcio/protobuf versions than the stubs (ams/api) need. Build
# here, once, with internet:
#     bash scripts/gpu_wheels.sh        # .whl/: the wheels and the test fonts, about 27 MB
# and carry .whl with the working tree (the device tool: carry [".whl"]). The copy has no .git
# to tell the commit measured: run it on a committed, clean tree and pass the commit:
#     XCLS_RESULTS_COMMIT=$(git rev-parse --short=7 HEAD) bash scripts/gpu_checks.sh
#
# Steps, in this order, each under its own time limit and all within GPU_CHECKS_SECONDS (480):
# a step that does not fit in the time left is skipped and named at the end, with the command
# that runs it (--only STEP, in a second call).
# In brackets, the seconds a step took on an H100 or H200 host; "about": the sum of its
# parts, measured when they ran grouped otherwise.
#   setup      the wheels into /tmp/site, the fonts under /usr/share/fonts, the shards' C row
#              update (ams/shard/_kernels.c) built in place [15]
#   tests      pytest -k cuda: heads, row update and prefetch staging on CUDA, collective
#              placement (its slice in GPU memory) on one rank and on two gloo ranks sharing
#              the GPU, the slice's working copy against the float64 optimizer, AMP training
#              runs that resume (AMS and collective), exact knn, top-k [67]
#   step-1m    bench_step at 1M classes: IResNet-50 at 112x112 under AMP, batch 256, d = 512,
#              backbone alone, knn on the embedded AMS and on shard processes, partial on
#              the AMS, knn and partial in collective placement (one rank) [90]
#   step-10m-ams         bench_step at 10M: backbone alone, knn on the embedded AMS and on
#                        shard processes (two 20 GB tables) [about 170]
#   step-10m-collective  bench_step at 10M: backbone alone, knn and partial in collective
#                        placement (the slice, 20 GB, in GPU memory) [about 125]
#   heads      bench_heads on CUDA at 1M: the head alone, exact graph [21]
#   step-100m  bench_step at 100M, rows in host RAM, float16, d = 128: backbone alone, knn [201]
#   graph-10m  bench_graph --device cuda: the exact graph of 10M rows (last: it has a figure
#              of its own already, and the steps' rows are the ones the targets name)
#              [over 200 with the rows' creation; the graph alone 142]
#
# Output: everything printed (the tables for RESULTS.md) also goes to $OUT/gpu_checks.log, and
# the benchmarks' records to $OUT/results/*.jsonl ($OUT: default runs/gpu-checks). Back here,
# append the records and render the pages:
#     for f in FILES_AT/results/*.jsonl; do cat "$f" >> "benchmarks/results/${f##*/}"; done
#     python benchmarks/render_results.py
#
# Usage: bash scripts/gpu_checks.sh [--dry-run] [--only STEP[,STEP...]]
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^# Usage/p' "$0" | sed 's/^# \{0,1\}//'; }
STEPS=(setup tests step-1m step-10m-ams step-10m-collective heads step-100m graph-10m)
dry=0
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry=1 ;;
    --only) only=${2:?--only needs a comma separated list of steps}; shift ;;
    *) echo "gpu_checks: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
for name in ${only//,/ }; do
  case " ${STEPS[*]} " in
    *" $name "*) ;;
    *) echo "gpu_checks: no step $name (steps: ${STEPS[*]})" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-checks}
BUDGET=${GPU_CHECKS_SECONDS:-480}
THREADS=8  # of the host's 16 cores; the prefetch and push threads and the shards use the rest
start=$SECONDS
failed=()
skipped=()

wanted() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (less if less is left)
step() {
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  if [ "$dry" = 1 ]; then
    printf '%s %ss: ' "$name" "$limit"; printf '%q ' "$@"; echo
    return 0
  fi
  local left=$((BUDGET - (SECONDS - start)))
  if [ "$left" -lt 30 ]; then
    skipped+=("$name")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (at most ${limit} s; $((SECONDS - start)) s in) ==="
  local began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - began)) s ==="
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

setup() {
  set -e
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  mkdir -p /usr/share/fonts/xcls-tests
  tar -xJf .whl/xcls-test-fonts.tar.xz -C /usr/share/fonts/xcls-tests
  "$PY" -c "from setuptools import setup; setup()" -q build_ext --inplace >/dev/null 2>&1 \
    || echo "setup: the C row update did not build: the shards update rows in torch"
  nvidia-smi -L
  "$PY" -c "import torch, grpc, lmdb, ams.api; print('torch', torch.__version__, 'cuda',
torch.version.cuda, torch.cuda.get_device_name(0), 'grpcio', grpc.__version__)"
}

if [ "$dry" = 0 ]; then
  mkdir -p "$OUT/results"
  exec > >(tee -a "$OUT/gpu_checks.log") 2>&1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  export XCLS_RESULTS_DIR="$OUT/results"
  echo "gpu_checks: commit ${XCLS_RESULTS_COMMIT:-unknown (set XCLS_RESULTS_COMMIT)}," \
    "budget ${BUDGET} s"
fi

export -f setup
export PY
step setup 90 bash -c setup
step tests 150 "$PY" -m pytest -q -p no:cacheprovider -k cuda tests
step step-1m 120 "$PY" benchmarks/bench_step.py --device cuda --sizes 1000000 \
  --threads "$THREADS"
# one placement's tables per step: the three 20 GB tables together outrun one step's limit
step step-10m-ams 240 "$PY" benchmarks/bench_step.py --device cuda --sizes 10000000 \
  --contenders backbone,knn-embedded,knn-shards --threads "$THREADS"
step step-10m-collective 180 "$PY" benchmarks/bench_step.py --device cuda --sizes 10000000 \
  --contenders backbone,knn-collective,partial-collective --threads "$THREADS"
step heads 90 "$PY" benchmarks/bench_heads.py --device cuda --sizes 1000000 --step-classes 0 \
  --exact-graph-max 1000000 --steps 3 --full-steps 1 --threads "$THREADS"
step step-100m 300 "$PY" benchmarks/bench_step.py --device cuda --sizes 100000000 \
  --dtype float16 --dim 128 --contenders backbone,knn-embedded --threads "$THREADS"
step graph-10m 240 "$PY" benchmarks/bench_graph.py --device cuda --sizes 10000000 --no-faiss \
  --recall-queries 1000 --threads "$THREADS"

[ "$dry" = 1 ] && exit 0
echo "gpu_checks: $((SECONDS - start)) s"
if [ ${#skipped[@]} -gt 0 ]; then
  list=$(IFS=,; echo "${skipped[*]}")
  echo "gpu_checks: out of time for: $list (next call, on a fresh machine with setup:" \
    "bash scripts/gpu_checks.sh --only setup,$list)"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_checks: failed: ${failed[*]}"
  exit 1
fi
