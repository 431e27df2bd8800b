"""FP8 base models on CUDA: the per-token quantize kernel, the decode-sized FP8 GEMM
(`loramux.kernels.fp8_gemm`) and cuBLASLt's (``torch._scaled_mm``) against the torch reference,
LoRA on top against PEFT, step graphs against eager steps, and the memory the FP8 weights leave
to the KV cache. Needs a GPU of compute capability 8.9 or newer; run on the GPU machine: ``pytest
-m gpu tests/test_fp8_gpu.py``.

cuBLASLt's GEMM writes bfloat16, so a float32 model's FP8 layer differs from the float32 reference by
bfloat16 rounding (2^-9 relative) on top of the order of its sums.
"""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch
from conftest import rel_err, tiny_llama, two_gpus
from test_fp8 import INPUT, LOGITS_TOLERANCE, fp8_layers, peft_logprobs, peft_on_fp8_base, prompt_logprobs
from test_fp8_checkpoint import compressed_tensors, write_fp8_checkpoint
from torch import nn

from loramux import LoRARequest, SamplingParams
from loramux.engine.quantization import Fp8Linear, quantize_model
from loramux.kernels import dispatch
from loramux.kernels.fp8_reference import fp8_matmul_ref, quantize_per_token_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU with FP8 (compute capability 8.9+)"),
]
BF16_ROUNDING = 2**-8


def LLM(*args, **kwargs):  # noqa: N802 - loramux's LLM with a small KV cache, as in test_engine_gpu
    from loramux.engine.llm import LLM as _LLM

    kwargs.setdefault("num_gpu_blocks_override", 512)
    return _LLM(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (64, 14336), (7, 48), (300, 1040)])
def test_the_quantize_kernel_gives_the_references_bits(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[0], device="cuda")[:, None]).to(dtype)
    x[0, : shape[1] // 2] = 0  # half a row of zeros
    if shape[0] > 1:
        x[1] = 0  # a row of zeros: the floor scale, zeros
    q, scale = dispatch.quantize_per_token(x)
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (shape[0], 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [4096, 48])  # 48: a shard of a small model, which only cuBLASLt takes
def test_the_fp8_gemm_equals_the_reference_to_bfloat16_rounding(dtype, k):
    torch.manual_seed(1)
    layer = Fp8Linear.from_linear(nn.Linear(k, 1024, bias=False, device="cuda", dtype=dtype))
    for tokens in (1, 3, 64, 1000):
        x = torch.randn(tokens, k, device="cuda", dtype=dtype)
        got = layer(x)  # the quantize launch, then the GEMM op
        xq, x_scale = quantize_per_token_ref(x)
        expected = fp8_matmul_ref(xq, x_scale, layer.weight, layer.weight_scale, torch.float32)
        assert got.dtype == dtype and got.shape == (tokens, 1024)
        assert rel_err(got, expected) < BF16_ROUNDING


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_the_decode_gemm_at_8b_shapes_equals_the_reference(n, k):
    torch.manual_seed(3)
    layer = Fp8Linear.from_linear(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    for tokens in (1, 16, 17, 64):  # each block height (16, 32, 64 rows)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        xq, x_scale = quantize_per_token_ref(x)
        expected = fp8_matmul_ref(xq, x_scale, layer.weight, layer.weight_scale, torch.float32)
        assert rel_err(layer(x), expected) < BF16_ROUNDING, tokens


def test_the_fp8_layer_compiles_and_replays_in_a_graph_as_it_runs_eagerly():
    torch.manual_seed(2)
    layer = Fp8Linear.from_linear(nn.Linear(256, 512, bias=True, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(2, 16, 256, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True)(x)
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    static.copy_(x * 2)
    graph.replay()
    # compiled, inductor fuses the quantize and divides as Triton's ``/`` does (not IEEE-rounded):
    # a value on the edge of two e4m3 values may round to the other
    assert rel_err(compiled, eager) < 2**-6
    assert torch.equal(out, layer(x * 2))


def test_a_graph_replays_the_k_parted_decode_gemm_over_new_inputs():
    from loramux.kernels.fp8_gemm import fp8_gemm_config, reserve_counters

    torch.manual_seed(4)
    layer = Fp8Linear.from_linear(nn.Linear(14336, 4096, bias=False, device="cuda", dtype=torch.bfloat16))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert fp8_gemm_config(64, 4096, 14336, sms).split_k > 1  # down_proj of an 8B model at 64 tokens
    reserve_counters("cuda")
    static = torch.randn(64, 14336, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    for _ in range(3):  # each replay finds the tile counters zero, as the last one left them
        x = torch.randn(64, 14336, device="cuda", dtype=torch.bfloat16)
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, layer(x))  # the parts are added in one order: the same bits


def test_a_tiny_model_on_cuda_is_close_to_the_unquantized_and_to_the_cpu_reference():
    base = tiny_llama().cuda()
    model = copy.deepcopy(base)
    quantize_model(model)
    cpu = tiny_llama()
    quantize_model(cpu)
    with torch.no_grad():
        got = model(INPUT.cuda()).logits
        assert rel_err(got, base(INPUT.cuda()).logits) < LOGITS_TOLERANCE
        assert rel_err(got, cpu(INPUT).logits) < 4 * BF16_ROUNDING


def test_an_adapters_delta_on_the_fp8_base_is_close_to_peft_delta_on_the_unquantized_model(engine_adapters):
    from peft import PeftModel

    adapter = engine_adapters["all"]
    prompts = INPUT.tolist()
    llm = LLM(tiny_llama().cuda(), quantization="fp8", max_loras=1, max_lora_rank=8, max_model_len=64)
    base, adapted = (prompt_logprobs(llm, prompts, [lora] * len(prompts))
                     for lora in (None, LoRARequest("all", 1, str(adapter))))
    expected_delta = (peft_logprobs(PeftModel.from_pretrained(tiny_llama(), adapter), INPUT)
                      - peft_logprobs(tiny_llama(), INPUT))
    assert rel_err(adapted - base, expected_delta) < LOGITS_TOLERANCE
    # and the engine's log-probs are PEFT's on the same FP8 base, to the GEMMs' bfloat16 rounding
    assert (adapted - peft_logprobs(peft_on_fp8_base(adapter).cuda(), INPUT.cuda())).abs().max() < 0.02


def test_greedy_with_adapters_on_an_fp8_base_replays_graphs_as_eager_steps_run(engine_adapters):
    """Compiled step graphs (the side-stream delta beside the FP8 GEMM, the pooled kernels) give
    the eager steps' tokens, for base requests and adapters in one batch."""
    names = [None, "attn", "all", "mlp", "all", None]
    ids = {"attn": 1, "all": 2, "mlp": 3}
    requests = [None if n is None else LoRARequest(n, ids[n], str(engine_adapters[n])) for n in names]
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (5, 17, 3, 9, 30, 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for enforce_eager in (True, False):
        llm = LLM(tiny_llama().cuda(), quantization="fp8", max_loras=3, max_lora_rank=8, max_num_seqs=8,
                  max_model_len=64, enforce_eager=enforce_eager)
        assert len(fp8_layers(llm.llm_engine.model)) == 8
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests,
                               use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
        if not enforce_eager:
            assert llm.llm_engine.runner.graph_steps > 0
        del llm
        gc.collect()
    assert tokens[0] == tokens[1]
    assert len({tuple(t) for t in tokens[0]}) > 3  # the adapters change the output


def test_a_checkpoint_saved_in_fp8_loads_on_cuda_as_the_model_quantized_at_load(tmp_path):
    from loramux.engine.worker.model_loader import load_model

    write_fp8_checkpoint(tmp_path, compressed_tensors("channel"))
    loaded, _ = load_model(tmp_path, device="cuda", dtype="bfloat16")
    flagged = tiny_llama()
    quantize_model(flagged)  # in float32, as the checkpoint was written
    flagged.to(device="cuda", dtype=torch.bfloat16)  # the FP8 weights and scales move; the rest is cast
    assert all(t.is_cuda for t in loaded.state_dict().values()) and len(fp8_layers(loaded)) == 14
    assert fp8_layers(loaded) == fp8_layers(flagged)
    for name in fp8_layers(loaded):
        layer, twin = loaded.get_submodule(name), flagged.get_submodule(name)
        assert torch.equal(layer.weight.view(torch.uint8), twin.weight.view(torch.uint8)), name  # the same bits
        assert torch.equal(layer.weight_scale, twin.weight_scale), name
    with torch.no_grad():  # the rest of each model is cast to bf16 apart (rotary tables): within bf16 rounding
        torch.testing.assert_close(loaded(INPUT.cuda()).logits, flagged(INPUT.cuda()).logits, rtol=2e-2, atol=1e-2)


MEDIUM = dict(model_type="llama", vocab_size=1024, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512)


def test_fp8_weights_take_half_the_memory_and_are_made_a_layer_at_a_time(tmp_path):
    from loramux.engine.worker.model_loader import load_model

    config = tmp_path / "medium.json"
    config.write_text(json.dumps(MEDIUM))
    weights, peaks = {}, {}
    for quantization in (None, "fp8"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model, _ = load_model(str(config), load_format="dummy", device="cuda", dtype="bfloat16",
                              quantization=quantization)
        weights[quantization] = torch.cuda.memory_allocated() - before
        peaks[quantization] = torch.cuda.max_memory_allocated() - before
        del model
    projections = 8 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192)  # parameters, 2 bytes each in bf16
    assert abs(weights[None] - weights["fp8"] - projections) < 0.02 * projections  # less the float32 scales
    # the FP8 weights (half) and one bf16 layer with its quantization scratch at a time: the whole
    # bf16 model never is on the GPU (quantizing it after loading would peak at 1.5x)
    assert peaks["fp8"] < weights[None]


@pytest.mark.whole_gpu  # the KV cache is sized from the device's free memory: no other test may hold any
def test_the_memory_fp8_weights_free_goes_to_the_kv_cache(tmp_path):
    from loramux.engine.worker.kv_cache import PagedKVCache
    from loramux.engine.llm_engine import LLMEngine

    config = tmp_path / "medium.json"
    config.write_text(json.dumps(MEDIUM))
    blocks, weights = {}, {}
    for quantization in (None, "fp8"):
        gc.collect()
        torch.cuda.empty_cache()
        engine = LLMEngine(str(config), load_format="dummy", quantization=quantization, enable_lora=False,
                           enforce_eager=True, max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.5)
        model = engine.model
        weights[quantization] = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
        blocks[quantization] = engine.kv_cache.num_blocks
        block_bytes = PagedKVCache.block_bytes(model.config.get_text_config(), engine.kv_cache.block_size,
                                               torch.bfloat16)
        engine.close()
        del engine, model
    freed = weights[None] - weights["fp8"]
    assert blocks["fp8"] - blocks[None] >= 0.9 * freed / block_bytes  # less the FP8 GEMMs' activation buffers


@two_gpus
def test_tensor_parallel_fp8_on_two_gpus_serves_adapters_as_one_gpu_does(tmp_path, engine_adapters):
    from conftest import char_tokenizer

    from loramux.engine.llm import LLM as _LLM

    tiny_llama().save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    prompts = INPUT.tolist()
    requests = [None, LoRARequest("all", 1, str(engine_adapters["all"])), LoRARequest("attn", 2,
                                                                                   str(engine_adapters["attn"]))]
    logprobs = []
    for tp in (1, 2):
        llm = _LLM(str(tmp_path), device="cuda", dtype="float32", quantization="fp8", tensor_parallel_size=tp,
                   max_loras=2, max_lora_rank=8, max_model_len=64, num_gpu_blocks_override=256)
        logprobs.append(prompt_logprobs(llm, prompts, requests))
        llm.llm_engine.close()
    assert (logprobs[0] - logprobs[1]).abs().max() < 0.05
