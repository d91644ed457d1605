#!/usr/bin/env bash
# Start one AMS shard on this host, reachable from the other hosts (binds 0.0.0.0, token auth).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/launch_server.sh [options] --auth-token-file FILE SHARD_ID NUM_SHARDS PORT DATA_DIR

Serve shard SHARD_ID (0-based) of NUM_SHARDS on PORT, on every interface of this host, with the
shared secret in FILE (every client must send it; required, since the shard listens on every
interface). Snapshots go to DATA_DIR, a directory
all shards of the cluster share (e.g. an NFS mount); the newest complete one is restored first.
Runs in the foreground; SIGTERM (or Ctrl-C) stops it cleanly: in-flight pushes finish, exit 0.

  --auth-token-file FILE  the shared secret (default: $AMS_TOKEN_FILE), as every xcls command
                          and launch_worker.sh take it
  --scheduler HOST:PORT   register with the job's scheduler and keep a lease (workers then
                          find the shards there); start it once, on any host, with
                          xcls serve scheduler --num-shards NUM_SHARDS --host 0.0.0.0 \
                              --port 7000 --auth-token-file FILE
  --advertise HOST        the name the scheduler hands to workers (default: this host's name);
                          with TLS, a name (or IP address) the certificate holds
  --tls-cert FILE         serve TLS with this PEM certificate chain (gRPC and the data port);
  --tls-key FILE          and its PEM private key. Workers name the signing authority
                          (launch_worker.sh --tls-ca)
  --data-port PORT        the port pulls and pushes travel on (default: a free one, which
                          clients learn from the shard); open both it and PORT in a firewall
  --metrics-port PORT     serve Prometheus /metrics on PORT, every interface
  --dry-run               print the command instead of running it
  -h, --help              this help

Environment: PYTHON  the Python that has xcls installed (default: python3)
             AMS_TOKEN_FILE  the token file, when --auth-token-file is not given

Example, shard 0 of 4 (run the same with 1, 2, 3 on the other shard hosts):
  openssl rand -hex 32 > /etc/xcls/token      # once; copy to every host, chmod 600
  scripts/launch_server.sh --scheduler sched:7000 --metrics-port 9100 \
      --auth-token-file /etc/xcls/token 0 4 7001 /mnt/shared/ams
EOF
}

dry_run=0
scheduler="" advertise="" metrics_port="" data_port="" token=${AMS_TOKEN_FILE:-}
tls_cert="" tls_key=""
args=()
need_value() {
    if (($2 < 2)); then
        echo "error: $1 needs a value (see --help)" >&2
        exit 2
    fi
}
while (($#)); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) dry_run=1; shift ;;
        --auth-token-file) need_value "$1" $#; token=$2; shift 2 ;;
        --scheduler) need_value "$1" $#; scheduler=$2; shift 2 ;;
        --advertise) need_value "$1" $#; advertise=$2; shift 2 ;;
        --metrics-port) need_value "$1" $#; metrics_port=$2; shift 2 ;;
        --data-port) need_value "$1" $#; data_port=$2; shift 2 ;;
        --tls-cert) need_value "$1" $#; tls_cert=$2; shift 2 ;;
        --tls-key) need_value "$1" $#; tls_key=$2; shift 2 ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
if ((${#args[@]} != 4)); then
    echo "error: expected SHARD_ID NUM_SHARDS PORT DATA_DIR, got ${#args[@]}" \
        "argument(s) (the token file goes in --auth-token-file; see --help)" >&2
    exit 2
fi
if [[ -z $token ]]; then
    echo "error: --auth-token-file FILE (or AMS_TOKEN_FILE) is required: the shard listens on" \
        "every interface (see --help)" >&2
    exit 2
fi
shard_id=${args[0]} num_shards=${args[1]} port=${args[2]} data_dir=${args[3]}
for pair in "SHARD_ID:$shard_id" "NUM_SHARDS:$num_shards" "PORT:$port" \
        ${metrics_port:+"--metrics-port:$metrics_port"} ${data_port:+"--data-port:$data_port"}; do
    if ! [[ ${pair#*:} =~ ^[0-9]+$ ]]; then
        echo "error: ${pair%%:*} must be a number, got '${pair#*:}'" >&2
        exit 2
    fi
done
# HOST:PORT, the host a name, an IPv4 address or a bracketed IPv6 one ([::1]:7000)
host_port='^(\[[0-9A-Fa-f:.]+\]|[^][:space:]:]+):[0-9]+$'
if [[ -n $scheduler ]] && ! [[ $scheduler =~ $host_port ]]; then
    echo "error: --scheduler must be HOST:PORT, got '$scheduler'" >&2
    exit 2
fi
if [[ -z $tls_cert && -n $tls_key || -n $tls_cert && -z $tls_key ]]; then
    echo "error: --tls-cert and --tls-key go together" >&2
    exit 2
fi
if [[ -n $advertise && -z $scheduler ]]; then
    echo "error: --advertise needs --scheduler" >&2
    exit 2
fi
# A dry run only shows the command, so the token file need not exist on this machine yet.
if ((!dry_run)) && [[ ! -s $token ]]; then
    echo "error: token file $token is missing or empty" >&2
    exit 2
fi

cmd=("${PYTHON:-python3}" -m xcls serve shard --shard-id "$shard_id" --num-shards "$num_shards"
     --host 0.0.0.0 --port "$port" --data-dir "$data_dir" --restore latest
     --auth-token-file "$token")
if [[ -n $scheduler ]]; then
    cmd+=(--scheduler "$scheduler" --advertise "${advertise:-$(hostname)}")
fi
if [[ -n $data_port ]]; then
    cmd+=(--data-port "$data_port")
fi
if [[ -n $tls_cert ]]; then
    cmd+=(--tls-cert "$tls_cert" --tls-key "$tls_key")
fi
if [[ -n $metrics_port ]]; then
    cmd+=(--metrics-port "$metrics_port" --metrics-host 0.0.0.0)
fi
if ((dry_run)); then
    echo "${cmd[*]@Q}"
    exit 0
fi
exec "${cmd[@]}"
