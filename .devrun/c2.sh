export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/src:$PWD
for s in 512x10x2048x512 128x8x2048x384 64x6x2048x1280; do
timeout 90 python3 benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets qwen3-30b-a3b@$s --tokens 2,4,8,32 --json $OUT/v-$s.json 2>&1 | grep -E "T=" | sed -E 's/, moekit [0-9]+ TFLOP.*//'
done
timeout 90 python3 benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets mixtral-8x7b@8x2x4096x7168,deepseek-v3 --tokens 2,4,8,32 --json $OUT/v-mx.json 2>&1 | grep -E "T=" | sed -E 's/, moekit [0-9]+ TFLOP.*//'
f() { grep -E "^T=|BEST|default" | sed -E "s/'group_m': ([0-9]+), //; s/'swap_ab': False, //; s/'engine': 'TL_DOT'//; s/'split_k': 1, //; s/'max_registers': None, //; s/'tail_block_m': None, //"; }
timeout 200 python3 benchmarks/sweep_configs.py --budget-s 150 --preset qwen3-30b-a3b@512x10x2048x512 --tokens 2,8 --where block_m=16 --json $OUT/sw-512.json > $OUT/sw-512.log 2>&1; python3 .devrun/top.py $OUT/sw-512.log
timeout 150 python3 benchmarks/sweep_configs.py --budget-s 100 --preset gpt-oss-120b --tokens 1 --where block_m=16 --json $OUT/sw-120.json > $OUT/sw-120.log 2>&1; python3 .devrun/top.py $OUT/sw-120.log
