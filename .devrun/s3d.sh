export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD:$PWD/benchmarks:$PWD/tools
t0=$(date +%s); s() { echo "== $1 $(( $(date +%s)-t0 ))s"; }
for case in "gpt-oss-120b@128x8x4096x1536 4096,16384" "gpt-oss-120b@256x8x7168x2048 8192,16384" "gpt-oss-120b@64x6x2048x1408 16384" "gpt-oss-20b 16384" "gpt-oss-120b 16384"; do
  set -- $case
  s "$1"
  timeout 110 python3 benchmarks/sweep_configs.py --preset $1 --tokens $2 --where engine=WGMMA_WORDS --budget-s 90 > $OUT/sweep_${1//@/_}.log 2>&1; echo rc $?
  grep -E "^T=|BEST|FAILED" $OUT/sweep_${1//@/_}.log | sed -E "s/'max_registers': None, //; s/'split_k': 1, //; s/'swap_ab': False, //" | cut -c1-230
done
s end
