#!/usr/bin/env bash
# One device call: tune PRESETS (graph-replay sweep of the Triton tuning space, verified winners into
# $OUT/h200_tuned.json), bench them with that table next to the torch._grouped_mm baseline, then the
# triton_kernels peer (gpt-oss-120b) at the same T. Copy $OUT/h200_tuned.json over
# src/moekit/tables/h200.json afterwards to ship the rows.
# Usage on the device (carry `peers`): bash benchmarks/gpu_tune_bench.sh PRESETS [TOKENS] [PEER=1]
# BENCH=0 stops after the sweep. Triton's cache lives in .triton_cache, tarred to $OUT: carry that tarball as
# .triton_cache.tgz and the next call untars it and skips those compiles.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz
PRESETS=${1:-gpt-oss-120b}
T=${2:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384}
PEER=${3:-1}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
cp src/moekit/tables/h200.json "$OUT/h200_tuned.json"
for P in ${PRESETS//,/ }; do
  timeout ${SWEEP_S:-300} python3 benchmarks/sweep_configs.py --preset "$P" --tokens "$T" --budget-s ${BUDGET_S:-270} \
    --table "$OUT/h200_tuned.json" --json "$OUT/sweep_$P.json" > "$OUT/sweep_$P.txt" 2>&1
  echo "sweep $P rc $?"; grep -E "BEST|budget" "$OUT/sweep_$P.txt" | cut -c1-150
done
if [ "${BENCH:-1}" = 0 ]; then tar czf "$OUT/triton_cache.tgz" .triton_cache; exit 0; fi
MOEKIT_TUNED_TABLE="$OUT/h200_tuned.json" timeout ${BENCH_S:-240} python3 benchmarks/bench_moe.py \
  --presets "$PRESETS" --tokens "$T" --json "$OUT/moekit.json" > "$OUT/bench.txt" 2>&1; echo "bench rc $?"
if [ "$PEER" = 1 ]; then
  timeout 150 python3 peers/bench_triton_kernels.py --tk-path peers --batches "$T" --json "$OUT/peer.json" \
    > "$OUT/peer.log" 2>&1; echo "peer rc $?"
  python3 benchmarks/bench_moe.py --table-only "$OUT/moekit.json" --peer-json "$OUT/peer.json"
else
  python3 benchmarks/bench_moe.py --table-only "$OUT/moekit.json"
fi
tar czf "$OUT/triton_cache.tgz" .triton_cache
