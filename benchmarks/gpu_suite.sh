#!/usr/bin/env bash
# A release's checks on the GPU machine in one run: the whole `pytest -m gpu` suite, then a short run
# of every maintained benchmark, each stage under its own time limit (seconds, overridable), writing
# as it goes, so a stage that runs out of time leaves the others' results. Everything lands in $OUT:
# each benchmark's JSON and log, the tests' log, status.txt (each stage's exit code) and the pages.
#
#   OUT=results LORAMUX_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_suite.sh
#
# Then, where the tree has git: cp results/*.json docs/benchmarks/ && python benchmarks/report.py --all
# (structured_output is measured on the host's CPU, where xgrammar is installed: not here.)
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=.
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1

stage() {  # stage NAME SECONDS COMMAND...: run it under its limit, log it, record its exit code
    local name=$1 limit=$2
    shift 2
    case " ${STAGES:-tests throughput throughput_fp8 throughput_tp many_adapters cold_load kernels report} " in
        *" $name "*) ;;
        *) return ;;  # STAGES="tests kernels" runs those alone (one device call each, say)
    esac
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?" | tee -a "$OUT/status.txt"
}

# the tests side by side (their Triton compiles take the host's cores; `whole_gpu` ones run alone)
stage tests "${TESTS_S:-600}" python -m pytest -m gpu -n "${TEST_WORKERS:-6}" -q -p no:cacheprovider -rfE \
    --durations=25 tests
stage throughput "${THROUGHPUT_S:-420}" python benchmarks/throughput.py --ranks 16 --adapters 1,32 \
    --peft-adapters 0 --output-len 64 --out "$OUT"
stage throughput_fp8 "${FP8_S:-420}" python benchmarks/throughput.py -q fp8 --ranks 16 --output-len 64 --out "$OUT"
if [ "$GPUS" -ge 2 ]; then
    stage throughput_tp "${TP_S:-540}" python benchmarks/throughput.py -tp 2 --ranks 16 --output-len 64 --out "$OUT"
fi
# the default N values under Zipf and uniform popularity (ten traces), fewer requests per trace
stage many_adapters "${MANY_S:-540}" python benchmarks/many_adapters.py --adapters "${MANY_N:-1,32,256,1000,2000}" \
    --popularity zipf,uniform --num-requests 96 --saturated-requests 96 --warm-replays 1 --saturated-repeats 1 \
    --cold-alone 4 --adapter-dir /var/tmp/loramux-adapters --out "$OUT"
rm -rf /var/tmp/loramux-adapters
stage cold_load "${COLD_S:-120}" python benchmarks/cold_load.py --out "$OUT"
VLLM=$([ -d .thirdparty/vllm_lora ] || echo --no-vllm)  # fetched with `python benchmarks/vllm_ops.py`
stage kernels "${KERNELS_S:-420}" python benchmarks/kernels.py --tokens 1,64,256,1024,8192 $VLLM --out "$OUT"
stage report 120 python benchmarks/report.py --all --results "$OUT"
