export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
git log -1 --format=%h 2>/dev/null
echo "=== GPU suite"
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD timeout 240 python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider 2>&1 | tail -2
for v in src .alt/src; do
echo "=== mx $v"
PYTHONPATH=$PWD/$v:$PWD timeout 80 python3 benchmarks/bench_moe.py --presets gpt-oss-120b,deepseek-v3 --tokens 1,2,3,4 --kernels planned 2>&1 | grep "^| [gd]" | cut -c1-60
done
echo "=== vllm new"
PYTHONPATH=$PWD/src:$PWD timeout 150 python3 benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets qwen3-30b-a3b@512x10x2048x512,qwen3-30b-a3b,deepseek-v3,qwen3-30b-a3b@128x8x2048x384 --tokens 1,2,3,4,6,8 --json $OUT/vl.json 2>&1 | grep -E " T=" | sed -E 's/, moekit [0-9]+ TFLOP.*//'
