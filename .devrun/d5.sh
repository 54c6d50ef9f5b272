export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD
t0=$(date +%s)
python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider > $OUT/suite.log 2>&1; echo "suite rc=$? $(( $(date +%s)-t0 ))s"; tail -1 $OUT/suite.log; grep -E "^FAILED" $OUT/suite.log | head
OLD=/tmp/site:$PWD/.alt/src:$PWD; NEW=/tmp/site:$PWD/src:$PWD
PR=qwen3-30b-a3b@512x10x2048x512,qwen3-30b-a3b,gpt-oss-120b,deepseek-v3
for v in old new old new; do
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 100 python3 benchmarks/bench_moe.py --presets $PR --tokens 3,4,8,32 --kernels planned > $OUT/bm-$v.log 2>&1
  echo "== $v $(( $(date +%s)-t0 ))s"; grep -E "^\| (qwen|gpt|deep)" $OUT/bm-$v.log | awk -F'|' '{printf "%s T=%s %s; ", $2, $3, $5}'; echo
done
PYTHONPATH=$NEW timeout 100 python3 benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets qwen3-30b-a3b@512x10x2048x512,qwen3-30b-a3b --tokens 3,4,8 > $OUT/vv.log 2>&1; grep -E "T=" $OUT/vv.log | cut -c1-120; echo "end $(( $(date +%s)-t0 ))s"
