#!/usr/bin/env bash
# The session's closing device call, in priority order, each step time-boxed; outputs land in $OUT as
# they go: GPU tests, `moekit run`, `moekit check --all`, then the other presets' sweep (shipped table).
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py tests/test_layer_gpu.py \
  > "$OUT/pytest_gpu.txt" 2>&1; echo "pytest rc $?"; tail -4 "$OUT/pytest_gpu.txt"
timeout 40 python3 -m moekit.app.cli run > "$OUT/run.txt" 2>&1; echo "run rc $?"; tail -12 "$OUT/run.txt"
timeout ${CHECK_S:-100} python3 -m moekit.app.cli check --all --tokens 1,64 > "$OUT/check.txt" 2>&1
echo "check rc $?"; tail -40 "$OUT/check.txt"
P=${PRESETS:-gpt-oss-20b,qwen3-30b-a3b,mixtral-8x7b,deepseek-v3}
timeout ${BENCH_S:-100} python3 benchmarks/bench_moe.py --presets "$P" --tokens ${TOKENS:-1,64,4096} \
  --json "$OUT/moekit_presets.json" > "$OUT/bench_presets.txt" 2>&1; echo "bench rc $?"
python3 benchmarks/bench_moe.py --table-only "$OUT/moekit_presets.json"
