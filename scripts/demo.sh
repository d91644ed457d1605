#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the main job on the embedded default: build a ~2k-class glyph
# dataset from Debian's CJK/Hangul fonts (skipped when it exists) and train the KNN-softmax
# head on it with in-process shards, printing top-1 on typeface designs never seen in training,
# then top-1 with each class's mean training feature as its row (xcls eval --rows class-means).
# Its last line gives the time and figures (benchmarks/demo.py); XCLS_DEMO_RECORD=1 also
# appends them to benchmarks/results/demo.jsonl, from which the README's demo time is rendered,
# and its top-1 to benchmarks/results/accuracy.csv (the accuracy tables' demo row).
# Extra arguments go to 'xcls train' (e.g. --set train.epochs=1): then only the time is shown.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
start=$(date +%s)
load=$(cut -d ' ' -f 1 /proc/loadavg)
data=data/glyphs-2k
# a run that resumes an earlier one (the config's train.out_dir) times a part of the demo only
resumed=()
[ -d runs/glyphs-2k-knn/checkpoints ] && resumed=(--resumed)
dataset_s=()
if [ ! -f "$data/summary.json" ]; then
  "$XCLS_PY" -m xcls data glyphs --classes 2000 --out "$data"
  dataset_s=(--dataset-s "$(( $(date +%s) - start ))")
fi
"$XCLS_PY" -m xcls train configs/glyphs-2k-knn.toml "$@"
means=$(mktemp)
trap 'rm -f "$means"' EXIT
"$XCLS_PY" -m xcls eval --rows class-means configs/glyphs-2k-knn.toml "$@" | tee "$means"
if (($#)); then
  echo "demo: dataset + training took $(( $(date +%s) - start )) s (with changed settings)"
else
  record=()
  [ "${XCLS_DEMO_RECORD:-0}" = 1 ] && record=(--record)
  "$XCLS_PY" benchmarks/demo.py configs/glyphs-2k-knn.toml --started "$start" --load "$load" \
    "${dataset_s[@]}" --eval-output "$means" "${resumed[@]}" "${record[@]}"
fi
