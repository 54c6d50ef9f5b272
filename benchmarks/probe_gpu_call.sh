#!/usr/bin/env bash
# One device call to explore a kernel change: config sweep of one preset, then the triton_kernels peer
# at the same T, all into $OUT. Usage (carry `peers`): bash benchmarks/probe_gpu_call.sh [PRESET] [TOKENS]
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=${1:-gpt-oss-120b}
T=${2:-1,8,64,512,2048,8192}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout ${SWEEP_S:-330} python3 benchmarks/sweep_configs.py --preset "$P" --tokens "$T" --budget-s 240 \
  --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1; echo "sweep rc $?"; grep -E "BEST|FAIL|budget" "$OUT/sweep.txt"
if [ "$P" = gpt-oss-120b ]; then
  timeout 150 python3 peers/bench_triton_kernels.py --tk-path peers --batches "$T" --json "$OUT/peer.json" \
    > "$OUT/peer.log" 2>&1; echo "peer rc $?"; tail -25 "$OUT/peer.log"
fi
