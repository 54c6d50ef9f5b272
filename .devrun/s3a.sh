export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD:$PWD/benchmarks:$PWD/tools
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t0=$(date +%s); s() { echo "== $1 $(( $(date +%s)-t0 ))s"; }
s words-mixtral
timeout 170 python3 benchmarks/proto_gluon_words.py --preset gpt-oss-120b@8x2x4096x14336 --tokens 512,2048,8192 --block-m 64,128 --stages 3,4 > $OUT/words_mixtral.log 2>&1; echo rc $?
tail -30 $OUT/words_mixtral.log
s words-gptoss
timeout 100 python3 benchmarks/proto_gluon_words.py --preset gpt-oss-120b --tokens 1024,4096 --block-m 64,128 --stages 3,4 > $OUT/words_gptoss.log 2>&1; echo rc $?
tail -20 $OUT/words_gptoss.log
s fp8
timeout 90 python3 benchmarks/proto_gluon_fp8_gemm1.py --preset deepseek-v3 --tokens 1024,4096,16384 > $OUT/fp8.log 2>&1; echo rc $?
tail -20 $OUT/fp8.log
s suite
timeout 170 python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider > $OUT/suite.log 2>&1; echo rc $?
tail -15 $OUT/suite.log
s end
