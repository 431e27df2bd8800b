#!/usr/bin/env bash
# The GPU tests of the engine and LoRA paths that a change to them must pass (a focused subset:
# the full `pytest -m gpu` spends ~8 minutes compiling the kernel tests' Triton variants).
#   OUT=results bash benchmarks/gpu_checks.sh
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=.
timeout "${TESTS_S:-480}" python -m pytest -m gpu -q -p no:cacheprovider -rfE \
    tests/test_engine_gpu.py tests/test_compilation.py tests/test_lora_model.py \
    tests/test_kernels.py::test_gpu_cuda_graph_replay_matches_eager \
    tests/test_kernels.py::test_gpu_graph_captured_with_all_base_rows_replays_any_mix \
    tests/test_kernels.py::test_gpu_dispatch_picks_triton_and_never_syncs tests/test_static_meta.py tests/test_embedding_shrink.py tests/test_layer_side_stream_gpu.py tests/test_capture_safety_gpu.py tests/test_pdl.py tests/test_slot_pool_kernels.py tests/test_tuned_kernel_configs.py tests/test_slot_write.py tests/test_pool_writer.py tests/test_prefill_gemm_gpu.py "$@" > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/status.txt"
tail -5 "$OUT/tests.log"
