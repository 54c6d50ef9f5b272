export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD
t0=$(date +%s)
python3 -m pytest -q -m gpu -n 8 tests --ignore=tests/gpu/test_fuzz.py --ignore=tests/gpu/test_interpreter_suite.py -p no:cacheprovider > $OUT/suite.log 2>&1; echo "suite rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $OUT/suite.log
timeout 150 python3 benchmarks/profile_stages.py --preset deepseek-v3 --tokens 1024,4096,16384 --repeats 3 > $OUT/prof-ds.log 2>&1; cat $OUT/prof-ds.log | tail -40
timeout 100 python3 benchmarks/profile_stages.py --preset qwen3-30b-a3b --tokens 4096,16384 --repeats 3 > $OUT/prof-q.log 2>&1; cat $OUT/prof-q.log | tail -30
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
timeout 150 ncu --clock-control none -k regex:'_fp8_gemm' --launch-skip 2 --launch-count 2 $S python3 .devrun/ncu_probe.py deepseek-v3 4096 > $OUT/ncu-ds.log 2>&1; grep -E "_fp8_gemm|Duration|DRAM Throughput|L2 Hit|Memory Throughput|Compute \(SM\)|Registers|Grid Size|Dynamic Shared|Achieved Occ|L1/TEX Hit|Mem Busy|Max Bandwidth" $OUT/ncu-ds.log
timeout 120 ncu --clock-control none -k regex:'_moe_gemm|_sum' --launch-skip 3 --launch-count 3 $S python3 .devrun/ncu_probe.py qwen3-30b-a3b 16384 > $OUT/ncu-q.log 2>&1; grep -E "_moe_|_sum|Duration|DRAM Throughput|L2 Hit|Memory Throughput|Compute \(SM\)|Registers|Grid Size|Dynamic Shared|Achieved Occ" $OUT/ncu-q.log
