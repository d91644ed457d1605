#!/usr/bin/env bash
# Start one AMS shard on this host, reachable from the other hosts (binds 0.0.0.0, token auth).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/launch_server.sh [--dry-run] SHARD_ID NUM_SHARDS PORT DATA_DIR TOKEN_FILE

Serve shard SHARD_ID (0-based) of NUM_SHARDS on PORT, on every interface of this host, with the
shared secret in TOKEN_FILE (every client must send it). Snapshots go to DATA_DIR, a directory
all shards of the cluster share (e.g. an NFS mount); the newest complete one is restored first.
Runs in the foreground; SIGTERM (or Ctrl-C) stops it cleanly: in-flight pushes finish, exit 0.

  --dry-run   print the command instead of running it
  -h, --help  this help

Environment: PYTHON  the Python that has xcls installed (default: python3)

Example, shard 0 of 4 (run the same with 1, 2, 3 on the other shard hosts):
  openssl rand -hex 32 > /etc/xcls/token      # once; copy to every host, chmod 600
  scripts/launch_server.sh 0 4 7001 /mnt/shared/ams /etc/xcls/token
EOF
}

dry_run=0
args=()
while (($#)); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) dry_run=1 ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) args+=("$1") ;;
    esac
    shift
done
if ((${#args[@]} != 5)); then
    echo "error: expected SHARD_ID NUM_SHARDS PORT DATA_DIR TOKEN_FILE, got ${#args[@]}" \
        "argument(s) (see --help)" >&2
    exit 2
fi
shard_id=${args[0]} num_shards=${args[1]} port=${args[2]} data_dir=${args[3]} token=${args[4]}
for pair in "SHARD_ID:$shard_id" "NUM_SHARDS:$num_shards" "PORT:$port"; do
    if ! [[ ${pair#*:} =~ ^[0-9]+$ ]]; then
        echo "error: ${pair%%:*} must be a number, got '${pair#*:}'" >&2
        exit 2
    fi
done
# A dry run only shows the command, so the token file need not exist on this machine yet.
if ((!dry_run)) && [[ ! -s $token ]]; then
    echo "error: TOKEN_FILE $token is missing or empty" >&2
    exit 2
fi

cmd=("${PYTHON:-python3}" -m xcls serve shard --shard-id "$shard_id" --num-shards "$num_shards"
     --host 0.0.0.0 --port "$port" --data-dir "$data_dir" --restore latest
     --auth-token-file "$token")
if ((dry_run)); then
    echo "${cmd[*]@Q}"
    exit 0
fi
exec "${cmd[@]}"
