#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the main job on the embedded default: build a ~2k-class glyph
# dataset from Debian's CJK/Hangul fonts (skipped when it exists) and train the KNN-softmax
# head on it with in-process shards, printing top-1 on typeface designs never seen in training,
# then top-1 with each class's mean training feature as its row (xcls eval --rows class-means).
# Extra arguments go to 'xcls train' (e.g. --set train.epochs=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
start=$(date +%s)
data=data/glyphs-2k
if [ ! -f "$data/summary.json" ]; then
  xcls data glyphs --classes 2000 --out "$data"
fi
xcls train configs/glyphs-2k-knn.toml "$@"
xcls eval --rows class-means configs/glyphs-2k-knn.toml "$@"
echo "demo: dataset + training took $(( $(date +%s) - start )) s"
