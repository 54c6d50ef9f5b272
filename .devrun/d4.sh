export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD/src:$PWD
t0=$(date +%s)
MX=gpt-oss-120b@8x2x4096x14336
T=256,512,1024,2048,4096,8192
timeout 150 python3 benchmarks/bench_moe.py --presets $MX --tokens $T --kernels planned > $OUT/mx.log 2>&1; grep -E "^\| gpt" $OUT/mx.log | cut -c1-100
timeout 150 python3 peers/bench_triton_kernels.py --tk-path peers --experts 8 --topk 2 --hidden 4096 --inter 14336 --batches $T --graph-max-m 16384 --no-baseline --json $OUT/peer.json > $OUT/peer.log 2>&1; tail -12 $OUT/peer.log
echo "t=$(( $(date +%s)-t0 ))"
timeout 100 python3 benchmarks/profile_stages.py --preset $MX --tokens 512,2048 --repeats 3 2>&1 | grep -E "^T=|kernels:"
echo "t=$(( $(date +%s)-t0 ))"
timeout 90 python3 benchmarks/profile_stages.py --preset qwen3-30b-a3b@512x10x2048x512 --tokens 2,4,8 --repeats 5 2>&1 | grep -E "^T=|kernels:"
echo "t=$(( $(date +%s)-t0 ))"
S="--section SpeedOfLight --section Occupancy --section LaunchStats"
timeout 100 ncu --clock-control none -k regex:'_moe_gemm' --launch-skip 2 --launch-count 2 $S python3 .devrun/ncu_probe.py $MX 512 > $OUT/ncu-mx.log 2>&1; grep -E "_moe_|Duration|DRAM Throughput|Compute \(SM\)|Registers|Grid Size|Achieved Occ|Block Size|Waves" $OUT/ncu-mx.log; head -3 $OUT/ncu-mx.log
echo "t=$(( $(date +%s)-t0 ))"
