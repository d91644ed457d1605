#!/usr/bin/env bash
# Start this host's training workers (one per GPU, or one without CUDA) with torchrun, against
# running AMS shards or, with --collective, holding the class rows themselves.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/launch_worker.sh [options] (--ams ADDR[,ADDR...] | --scheduler HOST:PORT |
                                          --collective) CONFIG [XCLS_TRAIN_ARGS...]

Run 'xcls train CONFIG' under torchrun on this host: NPROC_PER_NODE workers here (by default
one per GPU, or one on a host without CUDA), NNODES hosts in all, data-parallel over NCCL (gloo
without CUDA). The shards (scripts/launch_server.sh) must be serving first. Arguments after
CONFIG go to 'xcls train', e.g. --set train.epochs=5.

Two ways for the hosts to meet (torchrun's rendezvous):
  * c10d (--rdzv-endpoint HOST:PORT): every host runs the same command; torchrun assigns the
    ranks, and --nnodes MIN:MAX lets hosts join or leave (the job restarts from its newest
    checkpoint at the new size). Recommended.
  * static (--master-addr, no --rdzv-endpoint): each host gives its own --node-rank; node 0's
    address is the --master-addr of all; --nnodes is a fixed number.

Options (each falls back to the environment variable named, then the default):
  --ams ADDR,...          shard host:port list in shard order          AMS_ADDRESSES
  --scheduler HOST:PORT   find the shards through the job's scheduler  AMS_SCHEDULER
                          and keep a lease with it (a lost shard or
                          worker rolls training back); give this or --ams
  --collective            no shards: the workers hold the class rows,  (off)
                          sliced over the ranks (head.placement =
                          collective); give this, --ams or --scheduler
  --auth-token-file FILE  the shards' shared secret                    AMS_TOKEN_FILE (none)
  --tls-ca FILE           the authority that signed TLS shards'        AMS_TLS_CA_FILE (none:
                          certificates (PEM)                           plaintext)
  --rdzv-endpoint H:P     c10d rendezvous (a host all can reach; any   RDZV_ENDPOINT (none:
                          free port)                                   static)
  --rdzv-id ID            job id; the same on every host, new per job  RDZV_ID (xcls)
  --nnodes N|MIN:MAX      worker hosts in all (MIN:MAX: c10d only)     NNODES (1)
  --node-rank R           static: this host's index, 0..N-1            NODE_RANK (0)
  --master-addr HOST      address of node 0, reachable from all nodes  MASTER_ADDR (127.0.0.1)
  --master-port PORT      rendezvous port on node 0                    MASTER_PORT (29500)
  --nproc-per-node G      workers on this host: a number, or 'gpu'     NPROC_PER_NODE (one
                          (one per GPU torch sees; refused on a host   per GPU with CUDA,
                          without CUDA)                                else 1)
  --max-restarts N        times torchrun restarts the workers, e.g.    MAX_RESTARTS (3)
                          after a rollback (a lost shard: exit 75)
  --metrics-port PORT     Prometheus /metrics of local rank r on       METRICS_PORT (none)
                          PORT + r, every interface
  --torchrun ARG          one more argument for torchrun, repeatable,
                          e.g. --torchrun --monitor-interval=1
  --dry-run               print the command instead of running it
  -h, --help              this help

Environment: PYTHON  the Python that has xcls and torch installed (default: python3)

Example, two to four hosts with 8 GPUs each, shards on s0..s3; on every host:
  scripts/launch_worker.sh --nnodes 2:4 --rdzv-endpoint hostA:29400 --rdzv-id exp1 \
      --ams s0:7001,s1:7001,s2:7001,s3:7001 --auth-token-file /etc/xcls/token exp.toml
  With a scheduler (scripts/launch_server.sh --help) instead of the shard list:
  scripts/launch_worker.sh --nnodes 2 --rdzv-endpoint hostA:29400 --rdzv-id exp1 \
      --scheduler sched:7000 --auth-token-file /etc/xcls/token exp.toml
  Static, two hosts: --nnodes 2 --node-rank 0 --master-addr hostA on host A, --node-rank 1 on B.
NCCL on several hosts: docs/deploy.md, "On several hosts".
EOF
}

ams=${AMS_ADDRESSES:-}
collective=0
scheduler=${AMS_SCHEDULER:-}
metrics_port=${METRICS_PORT:-}
max_restarts=${MAX_RESTARTS:-3}
token=${AMS_TOKEN_FILE:-}
tls_ca=${AMS_TLS_CA_FILE:-}
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
master_addr=${MASTER_ADDR:-127.0.0.1}
master_port=${MASTER_PORT:-29500}
nproc=${NPROC_PER_NODE:-}  # none: one per GPU, or 1 without CUDA (below)
rdzv_endpoint=${RDZV_ENDPOINT:-}
rdzv_id=${RDZV_ID:-xcls}
torchrun_args=()
static_args=0  # --node-rank / --master-* given on the command line
dry_run=0
config=""
train_args=()

need_value() {
    if (($2 < 2)); then
        echo "error: $1 needs a value (see --help)" >&2
        exit 2
    fi
}

while (($#)); do
    if [[ -n $config ]]; then  # everything after CONFIG belongs to 'xcls train'
        train_args+=("$1")
        shift
        continue
    fi
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) dry_run=1; shift ;;
        --ams) need_value "$1" $#; ams=$2; shift 2 ;;
        --scheduler) need_value "$1" $#; scheduler=$2; shift 2 ;;
        --collective) collective=1; shift ;;
        --metrics-port) need_value "$1" $#; metrics_port=$2; shift 2 ;;
        --max-restarts) need_value "$1" $#; max_restarts=$2; shift 2 ;;
        --auth-token-file) need_value "$1" $#; token=$2; shift 2 ;;
        --tls-ca) need_value "$1" $#; tls_ca=$2; shift 2 ;;
        --rdzv-endpoint) need_value "$1" $#; rdzv_endpoint=$2; shift 2 ;;
        --rdzv-id) need_value "$1" $#; rdzv_id=$2; shift 2 ;;
        --torchrun) need_value "$1" $#; torchrun_args+=("$2"); shift 2 ;;
        --nnodes) need_value "$1" $#; nnodes=$2; shift 2 ;;
        --node-rank) need_value "$1" $#; node_rank=$2; static_args=1; shift 2 ;;
        --master-addr) need_value "$1" $#; master_addr=$2; static_args=1; shift 2 ;;
        --master-port) need_value "$1" $#; master_port=$2; static_args=1; shift 2 ;;
        --nproc-per-node) need_value "$1" $#; nproc=$2; shift 2 ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) config=$1; shift ;;
    esac
done

if [[ -z $config ]]; then
    echo "error: CONFIG is required (see --help)" >&2
    exit 2
fi
if ((collective)) && [[ -n $ams || -n $scheduler ]]; then
    echo "error: --collective keeps the rows in the workers; give no --ams or --scheduler" >&2
    exit 2
fi
if ((collective)) && [[ -n $tls_ca ]]; then
    echo "error: --tls-ca names the shards' authority; with --collective there are none" >&2
    exit 2
fi
if [[ -z $ams && -z $scheduler ]] && ! ((collective)); then
    echo "error: --ams (or AMS_ADDRESSES) or --scheduler (or AMS_SCHEDULER) is required:" \
        "the shards' host:port list, or the scheduler that knows them (or --collective)" >&2
    exit 2
fi
if [[ -n $ams && -n $scheduler ]]; then
    echo "error: give --ams or --scheduler, not both (the scheduler knows the shards)" >&2
    exit 2
fi
# HOST:PORT, the host a name, an IPv4 address or a bracketed IPv6 one ([::1]:7000)
host_port='^(\[[0-9A-Fa-f:.]+\]|[^][:space:]:]+):[0-9]+$'
if [[ -n $scheduler ]] && ! [[ $scheduler =~ $host_port ]]; then
    echo "error: --scheduler must be HOST:PORT, got '$scheduler'" >&2
    exit 2
fi
# Counts and ports are decimal: bash's arithmetic would read a leading zero as octal (08 is
# no number there), so each is checked by pattern and then written in base 10.
decimal() {  # FLAG NAME: refuse $NAME unless digits, then strip its leading zeros
    if ! [[ ${!2} =~ ^[0-9]+$ ]]; then
        echo "error: $1 must be a number, got '${!2}'" >&2
        exit 2
    fi
    printf -v "$2" '%d' "$((10#${!2}))"
}
if [[ -n $rdzv_endpoint ]]; then
    if ((static_args)); then
        echo "error: --node-rank, --master-addr and --master-port are for the static" \
            "rendezvous; with --rdzv-endpoint torchrun assigns the ranks" >&2
        exit 2
    fi
    if ! [[ $rdzv_endpoint =~ ^[^:[:space:]]+:[0-9]+$ ]]; then
        echo "error: --rdzv-endpoint must be HOST:PORT, got '$rdzv_endpoint'" >&2
        exit 2
    fi
    if ! [[ $nnodes =~ ^[0-9]+(:[0-9]+)?$ ]] \
            || ((10#${nnodes%%:*} < 1 || 10#${nnodes%%:*} > 10#${nnodes##*:})); then
        echo "error: --nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '$nnodes'" >&2
        exit 2
    fi
    if [[ $nnodes == *:* ]]; then
        nnodes="$((10#${nnodes%%:*})):$((10#${nnodes##*:}))"
    else
        nnodes=$((10#$nnodes))
    fi
else
    if [[ $nnodes == *:* ]]; then
        echo "error: --nnodes $nnodes: MIN:MAX needs the c10d rendezvous (--rdzv-endpoint)" >&2
        exit 2
    fi
    decimal --nnodes nnodes
fi
if [[ -z $rdzv_id || $rdzv_id =~ [[:space:]] ]]; then
    echo "error: --rdzv-id must be a non-empty word, got '$rdzv_id'" >&2
    exit 2
fi
for pair in --node-rank:node_rank --master-port:master_port --max-restarts:max_restarts \
        ${metrics_port:+--metrics-port:metrics_port}; do
    decimal "${pair%%:*}" "${pair#*:}"
done
if [[ -z $rdzv_endpoint ]] && ((node_rank >= nnodes)); then
    echo "error: --node-rank $node_rank must be below --nnodes $nnodes" >&2
    exit 2
fi
if ! [[ $nproc =~ ^([0-9]+|gpu)?$ ]]; then
    echo "error: --nproc-per-node must be a number or 'gpu', got '$nproc'" >&2
    exit 2
fi
[[ $nproc != [0-9]* ]] || decimal --nproc-per-node nproc
python=${PYTHON:-python3}
if [[ -z $nproc || $nproc == gpu ]]; then
    # the GPUs torch sees here (CUDA_VISIBLE_DEVICES included), as the workers will
    if ! gpus=$("$python" -c 'import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0)'); then
        echo "error: $python cannot count this host's GPUs with torch (set PYTHON, or give" \
            "--nproc-per-node N)" >&2
        exit 2
    fi
    if ((gpus > 0)); then
        nproc=$gpus
    elif [[ -z $nproc ]]; then
        nproc=1
    else
        echo "error: --nproc-per-node gpu: torch sees no CUDA GPU on this host; give a number" \
            "(the workers use gloo on the CPU)" >&2
        exit 2
    fi
fi
# torchrun as xcls runs it (python -m xcls.torchrun --help): a config refusal (exit 2) is not
# restarted, SIGTERM stops the workers at a checkpoint (exit 143), a restarted group gets a
# rendezvous store of its own
cmd=("$python" -m xcls.torchrun --nnodes "$nnodes")
if [[ -n $rdzv_endpoint ]]; then
    cmd+=(--rdzv-backend c10d --rdzv-endpoint "$rdzv_endpoint" --rdzv-id "$rdzv_id")
else
    cmd+=(--node-rank "$node_rank" --master-addr "$master_addr" --master-port "$master_port")
fi
cmd+=(--nproc-per-node "$nproc" --max-restarts "$max_restarts" "${torchrun_args[@]}"
      -m xcls train "$config")
if ((collective)); then
    cmd+=(--set "head.placement=collective")
elif [[ -n $scheduler ]]; then
    cmd+=(--set "ams.scheduler=$scheduler")
else
    cmd+=(--set "ams.addresses=$ams")
fi
if [[ -n $metrics_port ]]; then
    cmd+=(--metrics-port "$metrics_port" --metrics-host 0.0.0.0)
fi
if [[ -n $token ]]; then
    cmd+=(--set "ams.token_file=$token")
fi
if [[ -n $tls_ca ]]; then
    cmd+=(--set "ams.tls_ca_file=$tls_ca")
fi
cmd+=("${train_args[@]}")
if ((dry_run)); then
    echo "${cmd[*]@Q}"
    exit 0
fi
exec "${cmd[@]}"
