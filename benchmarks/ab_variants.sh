#!/usr/bin/env bash
# One device call that compares kernel variants of the source tree side by side: for each variant (a
# folder holding a `moekit` package; the checkout's `src` plus git-ignored copies of other branches'
# `src`), precompile the planned configs, run the GPU MXFP4 tests and the race hunt, then bench
# gpt-oss-120b at T (TESTS=0 skips the tests); the torch._grouped_mm baseline with the first variant, the triton_kernels peer
# (graph-timed) last when PEER=1.
# Usage on the device (carry `peers` and the variant folders):
#   VARIANTS="main=src bits=.alt/bits/src" bash benchmarks/ab_variants.sh [TOKENS] [PEER=1]
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz
T=${1:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384}
PEER=${2:-1}
PRESET=${PRESET:-gpt-oss-120b}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
for V in $VARIANTS; do  # compiles are CPU work: all variants at once (3 workers each: GPU memory)
  ( PYTHONPATH=$PWD/${V#*=}:$PWD/tests timeout ${COMPILE_S:-200} python3 benchmarks/precompile.py --planned \
      --preset "$PRESET" --tokens "$T" --workers ${WORKERS:-3} > "$OUT/precompile_${V%%=*}.txt" 2>&1 ) &
done
wait; tail -n 3 "$OUT"/precompile_*.txt
KERNELS=planned,torch_grouped
for V in $VARIANTS; do
  NAME=${V%%=*}; export PYTHONPATH=$PWD/${V#*=}:$PWD/tests
  if [ "${TESTS:-1}" = 1 ]; then
    timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py -k "${TEST_K:-mxfp4 or gpt}" \
      > "$OUT/pytest_$NAME.txt" 2>&1; echo "$NAME pytest rc $?"; tail -n 3 "$OUT/pytest_$NAME.txt"
  fi
  timeout ${RACE_S:-60} python3 benchmarks/race_hunt.py --presets "$PRESET" --tokens ${RACE_T:-8,64,512,1024,4096,16384} \
    > "$OUT/race_$NAME.txt" 2>&1; echo "$NAME race rc $?"; cat "$OUT/race_$NAME.txt" | cut -c1-160
  timeout ${BENCH_S:-150} python3 benchmarks/bench_moe.py --presets "$PRESET" --tokens "$T" --kernels "$KERNELS" \
    --json "$OUT/moekit_$NAME.json" > "$OUT/bench_$NAME.txt" 2>&1; echo "$NAME bench rc $?"
  KERNELS=planned
done
if [ "$PEER" = 1 ]; then
  timeout ${PEER_S:-150} python3 peers/bench_triton_kernels.py --tk-path peers --batches "$T" --graph-max-m 16384 \
    --json "$OUT/peer.json" > "$OUT/peer.log" 2>&1; echo "peer rc $?"
fi
for V in $VARIANTS; do
  NAME=${V%%=*}; echo "== $NAME"; [ -f "$OUT/peer.json" ] && PJ="--peer-json $OUT/peer.json" || PJ=""
  PYTHONPATH=$PWD/${V#*=} python3 benchmarks/bench_moe.py --table-only "$OUT/moekit_$NAME.json" $PJ
done
tar czf "$OUT/triton_cache.tgz" .triton_cache
