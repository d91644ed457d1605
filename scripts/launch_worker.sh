#!/usr/bin/env bash
# Start this host's training workers (one per GPU) with torchrun, against running AMS shards.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/launch_worker.sh [options] (--ams ADDR[,ADDR...] | --scheduler HOST:PORT) CONFIG
                                [XCLS_TRAIN_ARGS...]

Run 'xcls train CONFIG' under torchrun on this host: NPROC_PER_NODE workers here, NNODES hosts
in all, data-parallel over NCCL (gloo without CUDA). Run it on every worker host with its own
--node-rank; node 0's address is the --master-addr of all. The shards (scripts/launch_server.sh)
must be serving first. Arguments after CONFIG go to 'xcls train', e.g. --set train.epochs=5.

Options (each falls back to the environment variable named, then the default):
  --ams ADDR,...          shard host:port list in shard order          AMS_ADDRESSES
  --scheduler HOST:PORT   find the shards through the job's scheduler  AMS_SCHEDULER
                          and keep a lease with it (a lost shard or
                          worker rolls training back); give this or --ams
  --token-file FILE       the shards' shared secret                    AMS_TOKEN_FILE (none)
  --nnodes N              worker hosts in all                          NNODES (1)
  --node-rank R           this host's index, 0..N-1                    NODE_RANK (0)
  --master-addr HOST      address of node 0, reachable from all nodes  MASTER_ADDR (127.0.0.1)
  --master-port PORT      rendezvous port on node 0                    MASTER_PORT (29500)
  --nproc-per-node G      workers on this host: a number, or 'gpu'     NPROC_PER_NODE (gpu)
                          (one per visible GPU)
  --max-restarts N        times torchrun restarts the workers, e.g.    MAX_RESTARTS (3)
                          after a rollback (a lost shard: exit 75)
  --metrics-port PORT     Prometheus /metrics of local rank r on       METRICS_PORT (none)
                          PORT + r, every interface
  --dry-run               print the command instead of running it
  -h, --help              this help

Environment: PYTHON  the Python that has xcls and torch installed (default: python3)

Example, two hosts with 8 GPUs each, shards on s0..s3:
  host A: scripts/launch_worker.sh --nnodes 2 --node-rank 0 --master-addr hostA \
            --ams s0:7001,s1:7001,s2:7001,s3:7001 --token-file /etc/xcls/token exp.toml
  host B: the same with --node-rank 1
  With a scheduler (scripts/launch_server.sh --help) instead of the shard list:
  host A: scripts/launch_worker.sh --nnodes 2 --node-rank 0 --master-addr hostA \
            --scheduler sched:7000 --token-file /etc/xcls/token exp.toml
EOF
}

ams=${AMS_ADDRESSES:-}
scheduler=${AMS_SCHEDULER:-}
metrics_port=${METRICS_PORT:-}
max_restarts=${MAX_RESTARTS:-3}
token=${AMS_TOKEN_FILE:-}
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
master_addr=${MASTER_ADDR:-127.0.0.1}
master_port=${MASTER_PORT:-29500}
nproc=${NPROC_PER_NODE:-gpu}
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
        --metrics-port) need_value "$1" $#; metrics_port=$2; shift 2 ;;
        --max-restarts) need_value "$1" $#; max_restarts=$2; shift 2 ;;
        --token-file) need_value "$1" $#; token=$2; shift 2 ;;
        --nnodes) need_value "$1" $#; nnodes=$2; shift 2 ;;
        --node-rank) need_value "$1" $#; node_rank=$2; shift 2 ;;
        --master-addr) need_value "$1" $#; master_addr=$2; shift 2 ;;
        --master-port) need_value "$1" $#; master_port=$2; shift 2 ;;
        --nproc-per-node) need_value "$1" $#; nproc=$2; shift 2 ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) config=$1; shift ;;
    esac
done

if [[ -z $config ]]; then
    echo "error: CONFIG is required (see --help)" >&2
    exit 2
fi
if [[ -z $ams && -z $scheduler ]]; then
    echo "error: --ams (or AMS_ADDRESSES) or --scheduler (or AMS_SCHEDULER) is required:" \
        "the shards' host:port list, or the scheduler that knows them" >&2
    exit 2
fi
if [[ -n $ams && -n $scheduler ]]; then
    echo "error: give --ams or --scheduler, not both (the scheduler knows the shards)" >&2
    exit 2
fi
if [[ -n $scheduler ]] && ! [[ $scheduler =~ ^[^:[:space:]]+:[0-9]+$ ]]; then
    echo "error: --scheduler must be HOST:PORT, got '$scheduler'" >&2
    exit 2
fi
for pair in "--nnodes:$nnodes" "--node-rank:$node_rank" "--master-port:$master_port" \
        "--max-restarts:$max_restarts" \
        ${metrics_port:+"--metrics-port:$metrics_port"}; do
    if ! [[ ${pair#*:} =~ ^[0-9]+$ ]]; then
        echo "error: ${pair%%:*} must be a number, got '${pair#*:}'" >&2
        exit 2
    fi
done
if ((node_rank >= nnodes)); then
    echo "error: --node-rank $node_rank must be below --nnodes $nnodes" >&2
    exit 2
fi
if ! [[ $nproc =~ ^([0-9]+|gpu)$ ]]; then
    echo "error: --nproc-per-node must be a number or 'gpu', got '$nproc'" >&2
    exit 2
fi

cmd=("${PYTHON:-python3}" -m torch.distributed.run --nnodes "$nnodes" --node-rank "$node_rank"
     --master-addr "$master_addr" --master-port "$master_port" --nproc-per-node "$nproc"
     --max-restarts "$max_restarts"
     -m xcls train "$config")
if [[ -n $scheduler ]]; then
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
cmd+=("${train_args[@]}")
if ((dry_run)); then
    echo "${cmd[*]@Q}"
    exit 0
fi
exec "${cmd[@]}"
