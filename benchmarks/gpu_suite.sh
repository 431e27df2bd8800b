#!/usr/bin/env bash
# The GPU checks and benchmarks of a release in one call (device time is scarce); results under $OUT.
#   OUT=results bash benchmarks/gpu_suite.sh
# Each stage has a time limit (seconds, overridable) and writes its files as it goes, so a stage that
# runs out of time leaves the others' results.
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
timeout "${THROUGHPUT_S:-200}" python benchmarks/throughput.py --ranks 16 --adapters 1,32 --peft-adapters 0 \
    --json "$OUT/throughput.json" --markdown "$OUT/throughput.md" > "$OUT/throughput.log" 2>&1
echo "throughput rc=$?" >> "$OUT/status.txt"
timeout "${MANY_S:-320}" python benchmarks/many_adapters.py --tag h100 --out "$OUT" \
    --adapter-dir /var/tmp/loramux-adapters --adapters "${MANY_N:-4,32,256,1000}" --num-requests "${MANY_REQUESTS:-128}" \
    --saturated-requests "${MANY_SATURATED:-96}" > "$OUT/many_adapters.log" 2>&1
echo "many_adapters rc=$?" >> "$OUT/status.txt"
rm -rf /var/tmp/loramux-adapters
timeout "${TESTS_S:-120}" python -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_compilation.py \
    tests/test_engine_gpu.py::test_churn_with_graphs_loads_running_and_new_shapes_equals_eager \
    tests/test_engine_gpu.py::test_mixed_batch_on_cuda_matches_the_cpu_oracle > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/status.txt"
