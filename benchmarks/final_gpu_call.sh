#!/usr/bin/env bash
# The session's closing device call, in priority order, each step time-boxed; outputs land in $OUT as they go.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
git rev-parse --short HEAD 2>/dev/null > "$OUT/commit.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py tests/test_layer_gpu.py \
  > "$OUT/pytest_gpu.txt" 2>&1; echo "pytest rc $?"; tail -4 "$OUT/pytest_gpu.txt"
timeout 40 python3 -m moekit.cli run > "$OUT/run.txt" 2>&1; echo "run rc $?"; cat "$OUT/run.txt"
timeout 110 python3 -m moekit.cli check --all --tokens 1,64 > "$OUT/check.txt" 2>&1; echo "check rc $?"
T=1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384
timeout 60 python3 benchmarks/bench_moe.py --presets gpt-oss-120b --tokens $T --json "$OUT/moekit.json" \
  > "$OUT/bench.txt" 2>&1; echo "bench rc $?"
timeout 90 python3 peers/bench_triton_kernels.py --tk-path peers --batches $T --json "$OUT/peer.json" \
  > "$OUT/peer.log" 2>&1; echo "peer rc $?"
[ -s "$OUT/peer.json" ] && python3 benchmarks/bench_moe.py --help >/dev/null && python3 - "$OUT" <<'PY'
import json, sys, os
sys.path.insert(0, "benchmarks")
from bench_moe import _peer_us
from moekit.bench import BenchRecord
out = sys.argv[1]
d = json.load(open(os.path.join(out, "moekit.json")))
recs = [BenchRecord(**r) for r in d["records"]]
import bench_moe
bench_moe.print_table(recs, _peer_us(json.load(open(os.path.join(out, "peer.json")))))
PY
tail -3 "$OUT/check.txt"
