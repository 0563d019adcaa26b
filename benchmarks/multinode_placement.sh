#!/usr/bin/env bash
# Issue 12 item 3: two torchrun launches on this host act as 2 nodes x 2 processes (c10d rendezvous),
# compile a plan for the launched nodes (default "auto"; e.g. "2:2"), step once against one process and
# print each rank's node, plan devices and (real host, planned host) of every stage replica.
# Run: bash benchmarks/multinode_placement.sh [PLAN] [PORT]   (from the repository root)
# Analytic costs: tests/multinode_worker.py compares with a plan it makes again with analytic costs.
set -euo pipefail
plan=${1:-auto}; port=${2:-29741}
root=$(pwd); out=$(mktemp -d)
export FXPIPE_COSTS=analytic OMP_NUM_THREADS=1 FXPIPE_CALIBRATE=0 PYTHONPATH="$root"
for node in 0 1; do
  python -m torch.distributed.run --nnodes 2 --node-rank "$node" --nproc-per-node 2 --rdzv-backend c10d \
    --rdzv-endpoint "localhost:$port" --max-restarts 0 tests/multinode_worker.py "$out" "$plan" > "$out/launch$node.log" 2>&1 &
done
wait
for rank in 0 1 2 3; do
  python -c "
import json; r = json.load(open('$out/rank$rank.json'))
print(f\"rank {r['rank']} on {r['node']}: cluster {r['cluster']}, layout {r['layout']}, stage devices {r['devices']}, \"
      f\"(real host, planned host) per replica {r['placement']}, exact {r['exact']}, loss {r['loss']:.5f} \"
      f\"(one process {r['expected']:.5f})\")"
done
