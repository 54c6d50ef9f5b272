export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
N="PYTHONPATH=$PWD/src:$PWD"; A="PYTHONPATH=$PWD/.alt/src:$PWD"
echo "=== profile"
for p in qwen3-30b-a3b@512x10x2048x512:1,2,4,8 qwen3-30b-a3b:1,2,4 gpt-oss-120b:1,2,8 deepseek-v3:1,2,8; do
 env $N timeout 100 python3 benchmarks/profile_stages.py --preset ${p%%:*} --tokens ${p##*:} --repeats 5 --json $OUT/prof-${p%%[@:]*}.json 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -8
done
for v in N A; do
echo "=== vllm $v"
env ${!v} timeout 120 python3 benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets qwen3-30b-a3b@512x10x2048x512,qwen3-30b-a3b,deepseek-v3 --tokens 1,2,4,8,16 --json $OUT/vl-$v.json 2>&1 | grep -E "T=" | sed -E 's/, moekit [0-9]+ TFLOP.*//'
echo "=== mxfp4 $v"
env ${!v} timeout 100 python3 benchmarks/bench_moe.py --presets gpt-oss-120b,gpt-oss-20b --tokens 1,2,4,8 --kernels planned --json $OUT/mx-$v.json 2>&1 | grep "^| gpt"
done
