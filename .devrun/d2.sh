export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD
t0=$(date +%s)
python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider > $OUT/suite.log 2>&1; echo "suite rc=$? $(( $(date +%s)-t0 ))s"; tail -2 $OUT/suite.log; grep -E "FAIL|Error" $OUT/suite.log | head -20
OLD=/tmp/site:$PWD/.alt/src:$PWD; NEW=/tmp/site:$PWD/src:$PWD
PYTHONPATH=$OLD python3 .devrun/align_bench.py old > $OUT/al-old.log 2>&1
PYTHONPATH=$NEW python3 .devrun/align_bench.py new > $OUT/al-new.log 2>&1
paste -d'|' $OUT/al-old.log $OUT/al-new.log | sed -E 's/\|new E=.*: / -> /'
for v in old new old new; do
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 200 python3 benchmarks/bench_moe.py --presets qwen3-30b-a3b,gpt-oss-120b,mixtral-8x7b --tokens 256,1024,4096 --kernels planned > $OUT/bm-$v.log 2>&1
  echo "== $v"; grep -E "^\| (qwen|gpt|mix)" $OUT/bm-$v.log | cut -c1-120
done
PYTHONPATH=$OLD timeout 150 python3 benchmarks/bench_moe.py --presets deepseek-v3 --tokens 2048,4096 --kernels planned > $OUT/ds-old.log 2>&1
PYTHONPATH=$NEW timeout 150 python3 benchmarks/bench_moe.py --presets deepseek-v3 --tokens 2048,4096 --kernels planned > $OUT/ds-new.log 2>&1
grep -E "^\| deep" $OUT/ds-old.log $OUT/ds-new.log | cut -c1-140
