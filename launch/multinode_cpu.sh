#!/usr/bin/env bash
# Two torchrun agents on THIS machine acting as the two "nodes" of a multi-node job:
# gloo on CPU, c10d rendezvous on 127.0.0.1. Exactly the commands of a real two-node
# run (launch/README.md, "Going past one machine"), with 127.0.0.1 standing in for the
# head node's address. Each agent starts NPROC_PER_NODE workers (default 1), so the
# world is 2 x NPROC_PER_NODE ranks forming one ring.
#
#   launch/multinode_cpu.sh                       # 30 training steps, world size 2
#   launch/multinode_cpu.sh --steps 150 --metrics-out /tmp/metrics.json
#   NPROC_PER_NODE=2 launch/multinode_cpu.sh --sp-size 2   # 2 nodes x 2: dp 2 x sp 2
#
# Arguments are passed to launch/train.py. Output lines carry [node0] / [node1].
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-29531}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
RDZV_ID=${RDZV_ID:-ringflash-cpu-$$}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}   # the interface gloo uses between "nodes"
export CUDA_VISIBLE_DEVICES=""                        # CPU demo, even on a GPU machine

if [ $# -eq 0 ]; then
    set -- --steps 30
fi

# Every node runs the same command; only is_host differs (which agent serves the
# rendezvous store). On real nodes torchrun works it out from the endpoint's hostname.
launch() {
    local node=$1 is_host=$2
    shift 2
    exec torchrun --nnodes=2 --nproc-per-node="$NPROC_PER_NODE" \
        --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$PORT" --rdzv-id="$RDZV_ID" \
        --rdzv-conf="is_host=$is_host,join_timeout=120" --max-restarts=0 \
        launch/train.py "$@" > >(sed -u "s/^/[$node] /") 2>&1
}

launch node0 1 "$@" &
NODE0=$!
sleep 1   # let node0 open the store before node1 dials it (node1 would retry anyway)
launch node1 0 "$@" &
NODE1=$!
trap 'kill "$NODE0" "$NODE1" 2>/dev/null || true' INT TERM

# The first node to finish decides: if it failed, stop the other rather than leave it
# waiting in a collective until --dist-timeout.
status=0
wait -n -p first "$NODE0" "$NODE1" || status=$?
if [ "$first" = "$NODE0" ]; then other=$NODE1; else other=$NODE0; fi
if [ "$status" -ne 0 ]; then
    kill "$other" 2>/dev/null || true
fi
wait "$other" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
if [ "$status" -eq 0 ]; then
    echo "multinode_cpu: both nodes finished"
else
    echo "multinode_cpu: a node failed (exit status $status)" >&2
fi
exit "$status"
