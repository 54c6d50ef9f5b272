export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1; mkdir -p $OUT
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_gpu.py -k "words or gpt-oss-20b" > $OUT/pytest_gpu.txt 2>&1; echo "pytest rc $?"; tail -4 $OUT/pytest_gpu.txt
bash benchmarks/gpu_tune_bench.sh gpt-oss-120b
