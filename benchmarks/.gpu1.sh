set -u
export PYTHONPATH=.
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_slot_pool_kernels.py tests/test_lora_model.py > $OUT/pool_tests.log 2>&1; echo "pool tests rc=$?" >> $OUT/status.txt
tail -3 $OUT/pool_tests.log
timeout 150 python benchmarks/lora_decode.py --tokens 1,64 --ranks 16,64 --mixes 1,32 --paths overlap,overlap_pool,overlap_exact --kernel-times --out $OUT/ld > $OUT/ld.log 2>&1; echo "ld rc=$?" >> $OUT/status.txt
tail -10 $OUT/ld.log
timeout 240 python benchmarks/throughput.py --peft-adapters 0 --json $OUT/throughput.json --markdown $OUT/throughput.md > $OUT/tp.log 2>&1; echo "tp rc=$?" >> $OUT/status.txt
head -16 $OUT/throughput.md
cat $OUT/status.txt
