export TRITON_CACHE_DIR=$PWD/.triton_cache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests:$PWD:$PWD/benchmarks:$PWD/tools
t0=$(date +%s); s() { echo "== $1 $(( $(date +%s)-t0 ))s"; }
s words-mixtral
timeout 120 python3 benchmarks/proto_gluon_words.py --preset gpt-oss-120b@8x2x4096x14336 --tokens 1024,2048,4096,8192 --block-m 128,256 --stages 3,4 > $OUT/words_mixtral.log 2>&1; echo rc $?
grep -v Warn $OUT/words_mixtral.log | grep -v _warn_once
s words-gptoss
timeout 80 python3 benchmarks/proto_gluon_words.py --preset gpt-oss-120b --tokens 8192,16384 --block-m 128,256 --stages 4 > $OUT/words_gptoss.log 2>&1; echo rc $?
grep -v Warn $OUT/words_gptoss.log | grep -v _warn_once
s words-20b
timeout 60 python3 benchmarks/proto_gluon_words.py --preset gpt-oss-20b --tokens 4096,16384 --block-m 128,256 --stages 4 > $OUT/words_20b.log 2>&1; echo rc $?
grep -v Warn $OUT/words_20b.log | grep -v _warn_once
s peer
timeout 100 python3 peers/bench_triton_kernels.py --tk-path peers --experts 8 --topk 2 --hidden 4096 --inter 14336 --batches 512,1024,2048,4096,8192 --graph-max-m 16384 --no-baseline > $OUT/peer_mixtral.log 2>&1; echo rc $?
tail -12 $OUT/peer_mixtral.log
s moekit
timeout 100 python3 benchmarks/bench_moe.py --presets gpt-oss-120b@8x2x4096x14336 --tokens 512,1024,2048,4096,8192 --kernels planned > $OUT/moekit_mixtral.log 2>&1; echo rc $?
grep "^|" $OUT/moekit_mixtral.log | cut -c1-160
s end
