export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
for v in src .alt/src; do
echo "=== $v"
PYTHONPATH=$PWD/$v:$PWD timeout 70 python3 benchmarks/bench_moe.py --presets gpt-oss-120b,qwen3-30b-a3b,deepseek-v3 --tokens 4,8,32 --kernels planned 2>&1 | grep "^| [gdq]" | cut -c1-50
done
echo "=== GPU suite"
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD timeout 150 python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider 2>&1 | tail -2
