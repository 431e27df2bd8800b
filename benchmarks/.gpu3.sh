set -u
export PYTHONPATH=.
OUT=$OUT TESTS_S=220 bash benchmarks/gpu_checks.sh tests/test_slot_pool_kernels.py > /dev/null 2>&1; cat $OUT/status.txt; grep -E "passed|failed" $OUT/tests.log | tail -2; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
for S in 32 256; do timeout 100 python benchmarks/lora_decode.py --tokens 1,64 --ranks 16 --mixes 1,32 --slots $S --paths overlap_pool,overlap_exact --out $OUT/ld_s$S > $OUT/ld_s$S.log 2>&1; echo "ld S=$S rc=$?"; grep "^| fused" $OUT/ld_s$S.log; done
timeout 200 python benchmarks/throughput.py --peft-adapters 0 --ranks 16 --json $OUT/throughput.json --markdown $OUT/throughput.md > $OUT/tp.log 2>&1; echo "tp rc=$?"; head -12 $OUT/throughput.md | tail -9
