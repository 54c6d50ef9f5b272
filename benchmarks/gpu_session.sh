#!/usr/bin/env bash
# One device call: GPU tests, moekit bench (planned kernel + unfused baseline) and the triton_kernels peer,
# side by side. Usage on the device: bash benchmarks/gpu_session.sh [quick]
# Needs peers/ (git-ignored: triton_kernels + bench_triton_kernels.py) carried along.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=${1:-full}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
if [ "$mode" = quick ]; then
  timeout 400 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -40
  exit 0
fi
timeout 900 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -30
T=${TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384}
timeout 900 python3 peers/bench_triton_kernels.py --tk-path peers --batches "$T" --json "$OUT/peer.json" \
  > "$OUT/peer.log" 2>&1; tail -25 "$OUT/peer.log"
timeout 900 python3 benchmarks/bench_moe.py --presets gpt-oss-120b --tokens "$T" --json "$OUT/moekit.json" \
  --peer-json "$OUT/peer.json" 2>&1 | tee "$OUT/bench.txt" | tail -22
