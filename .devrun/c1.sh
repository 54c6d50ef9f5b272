export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
git log -1 --oneline 2>/dev/null
echo "=== GPU suite"
time PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD timeout 300 python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider 2>&1 | tail -15
for round in 1 2; do
echo "=== new T=1,2 round $round"
PYTHONPATH=$PWD/src:$PWD timeout 100 python3 benchmarks/bench_moe.py --presets gpt-oss-120b,qwen3-30b-a3b,deepseek-v3 --tokens 1,2 --kernels planned --json $OUT/new$round.json 2>&1 | tail -12
echo "=== old (b3d1287) T=1,2 round $round"
PYTHONPATH=$PWD/.alt/src:$PWD timeout 100 python3 benchmarks/bench_moe.py --presets gpt-oss-120b,qwen3-30b-a3b,deepseek-v3 --tokens 1,2 --kernels planned --json $OUT/old$round.json 2>&1 | tail -12
done
echo "=== vllm E512"
PYTHONPATH=$PWD/src:$PWD timeout 120 python3 benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets qwen3-30b-a3b@512x10x2048x512,gpt-oss-120b --tokens 1,2,16 --json $OUT/vllm.json 2>&1 | tail -20
