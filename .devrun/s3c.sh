export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD:$PWD/benchmarks:$PWD/tools
t0=$(date +%s); s() { echo "== $1 $(( $(date +%s)-t0 ))s"; }
s new-tests
timeout 140 python3 -m pytest -q -m gpu -n 8 tests/gpu/test_wgmma_words_gpu.py -p no:cacheprovider > $OUT/new_tests.log 2>&1; echo rc $?
grep -E "passed|failed|Error|assert" $OUT/new_tests.log | head -30
s bench
timeout 120 python3 benchmarks/bench_moe.py --presets gpt-oss-120b@8x2x4096x14336 --tokens 256,512,1024,2048,4096,8192 --kernels planned > $OUT/moekit_mixtral.log 2>&1; echo rc $?
grep "^|" $OUT/moekit_mixtral.log | cut -c1-120
s peer
timeout 100 python3 peers/bench_triton_kernels.py --tk-path peers --experts 8 --topk 2 --hidden 4096 --inter 14336 --batches 256,512,1024,2048,4096,8192 --graph-max-m 16384 --no-baseline > $OUT/peer_mixtral.log 2>&1; echo rc $?
tail -8 $OUT/peer_mixtral.log
s suite
timeout 175 python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py --ignore=tests/gpu/test_wgmma_words_gpu.py -p no:cacheprovider > $OUT/suite.log 2>&1; echo rc $?
tail -3 $OUT/suite.log
s end
