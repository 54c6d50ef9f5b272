export TRITON_CACHE_DIR=$PWD/.triton_cache
t0=$(date +%s)
for v in old new; do
  if [ $v = old ]; then P=$PWD/.alt/src:$PWD; else P=$PWD/src:$PWD; fi
  PYTHONPATH=$P timeout 85 python3 benchmarks/bench_moe.py --presets qwen3-30b-a3b@512x10x2048x512,gpt-oss-120b,qwen3-30b-a3b --tokens 2,3,4,6,8 --kernels planned > $OUT/bm-$v.log 2>&1
  echo "== $v $(( $(date +%s)-t0 ))s"; grep -E "^\| (qwen|gpt)" $OUT/bm-$v.log | awk -F'|' '{printf "%s T=%s %s; ", $2, $3, $5}'; echo
done
