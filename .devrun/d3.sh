export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD
t0=$(date +%s)
python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider > $OUT/suite.log 2>&1; echo "suite rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $OUT/suite.log; grep -E "^FAILED|^E " $OUT/suite.log | head -20
OLD=/tmp/site:$PWD/.alt/src:$PWD; NEW=/tmp/site:$PWD/src:$PWD
for v in old new old new; do
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 120 python3 benchmarks/bench_moe.py --presets deepseek-v3 --tokens 2048,4096,16384 --kernels planned > $OUT/ds-$v.log 2>&1
  echo "== $v $(( $(date +%s)-t0 ))s"; grep -E "^\| deep" $OUT/ds-$v.log | cut -c1-90
done
for v in old new; do
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 100 python3 benchmarks/bench_moe.py --presets deepseek-v3@128x8x4096x1536,deepseek-v3@64x6x2048x1280 --tokens 1024,4096 --kernels planned > $OUT/ho-$v.log 2>&1
  echo "== $v $(( $(date +%s)-t0 ))s"; grep -E "^\| deep" $OUT/ho-$v.log | cut -c1-90
done
PYTHONPATH=$NEW timeout 120 python3 benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets deepseek-v3 --tokens 4096,16384 > $OUT/vv.log 2>&1; grep -E "T=" $OUT/vv.log | cut -c1-200; echo "end $(( $(date +%s)-t0 ))s"
