#!/usr/bin/env bash
# One device call for kernel work: GPU tests, autotune into a table, then moekit's benchmark with that
# table next to the triton_kernels peer. Everything lands in $OUT (the device's tree does not come back):
# copy $OUT/h200_tuned.json over src/moekit/tables/h200.json afterwards to ship the rows.
# Usage on the device (carry `peers`): bash benchmarks/gpu_session.sh [PRESET] [TOKENS]
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=${1:-gpt-oss-120b}
T=${2:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py tests/test_layer_gpu.py \
  > "$OUT/pytest_gpu.txt" 2>&1; echo "pytest rc $?"; tail -2 "$OUT/pytest_gpu.txt"
cp src/moekit/tables/h200.json "$OUT/h200_tuned.json"
timeout 300 python3 -m moekit.cli tune --preset "$P" --tokens "$T" --table "$OUT/h200_tuned.json" \
  > "$OUT/tune.txt" 2>&1; echo "tune rc $?"; tail -25 "$OUT/tune.txt"
MOEKIT_TUNED_TABLE="$OUT/h200_tuned.json" timeout 120 python3 benchmarks/bench_moe.py --presets "$P" \
  --tokens "$T" --json "$OUT/moekit.json" > "$OUT/bench.txt" 2>&1; echo "bench rc $?"
timeout 120 python3 peers/bench_triton_kernels.py --tk-path peers --batches "$T" --json "$OUT/peer.json" \
  > "$OUT/peer.log" 2>&1; echo "peer rc $?"
python3 benchmarks/bench_moe.py --table-only "$OUT/moekit.json" --peer-json "$OUT/peer.json"
