export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
echo "=== GPU suite"
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD timeout 300 python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider 2>&1 | tail -4
N="PYTHONPATH=$PWD/src:$PWD"; A="PYTHONPATH=$PWD/.alt/src:$PWD"
for v in N A; do
echo "=== vllm $v"
env ${!v} timeout 150 python3 benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets qwen3-30b-a3b@512x10x2048x512,qwen3-30b-a3b,deepseek-v3,qwen3-30b-a3b@64x6x2048x1280 --tokens 1,2,3,4,6,8 --json $OUT/vl-$v.json 2>&1 | grep -E "T=" | sed -E 's/, moekit [0-9]+ TFLOP.*//'
echo "=== mxfp4 $v"
env ${!v} timeout 100 python3 benchmarks/bench_moe.py --presets gpt-oss-120b,gpt-oss-20b --tokens 1,2,3,4,6,8 --kernels planned --json $OUT/mx-$v.json 2>&1 | grep "^| gpt"
done
