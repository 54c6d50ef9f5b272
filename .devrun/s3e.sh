export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD:$PWD/benchmarks:$PWD/tools
t0=$(date +%s); s() { echo "== $1 $(( $(date +%s)-t0 ))s"; }
for case in "gpt-oss-120b@64x4x2880x2880 2048,4096" "gpt-oss-120b@128x8x4096x1536 2048"; do
  set -- $case
  s "$1"
  timeout 60 python3 benchmarks/sweep_configs.py --preset $1 --tokens $2 --where engine=WGMMA_WORDS --budget-s 45 > $OUT/sweep_${1//@/_}.log 2>&1; echo rc $?
  grep -E "^T=|BEST|FAILED" $OUT/sweep_${1//@/_}.log | sed -E "s/'max_registers': None, //; s/'split_k': 1, //; s/'swap_ab': False, //; s/'block_n': 64, 'block_k': 64, //; s/'gemm2_block_n': 128, 'tail_block_m': None, //" | cut -c1-200
done
s moekit
timeout 70 python3 benchmarks/bench_moe.py --presets gpt-oss-120b@128x8x4096x1536 --tokens 2048,4096,16384 --kernels planned > $OUT/moekit_qwen.log 2>&1; echo rc $?
grep "^| gpt" $OUT/moekit_qwen.log | cut -c1-120
s peer
timeout 70 python3 peers/bench_triton_kernels.py --tk-path peers --experts 128 --topk 8 --hidden 4096 --inter 1536 --batches 2048,4096,16384 --graph-max-m 16384 --no-baseline > $OUT/peer_qwen.log 2>&1; echo rc $?
tail -4 $OUT/peer_qwen.log
s end
