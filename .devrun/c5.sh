export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
for v in src .alt/src .alt2/src; do PYTHONPATH=$PWD/$v:$PWD timeout 100 python3 benchmarks/bench_moe.py --presets gpt-oss-120b --tokens 2,3 --kernels planned > /dev/null 2>&1; done  # compile
for round in 1 2; do for v in src .alt/src .alt2/src; do
echo "=== $v round $round"
PYTHONPATH=$PWD/$v:$PWD timeout 100 python3 benchmarks/bench_moe.py --presets gpt-oss-120b,deepseek-v3 --tokens 2,3,4 --kernels planned 2>&1 | grep "^| [gd]" | cut -c1-60
done; done
echo "=== profile new"
PYTHONPATH=$PWD/src:$PWD timeout 100 python3 benchmarks/profile_stages.py --preset gpt-oss-120b --tokens 2,3 --repeats 5 2>&1 | grep -E "^T=|kernels"
echo "=== profile alt2"
PYTHONPATH=$PWD/.alt2/src:$PWD timeout 100 python3 benchmarks/profile_stages.py --preset gpt-oss-120b --tokens 2,3 --repeats 5 2>&1 | grep -E "^T=|kernels"
