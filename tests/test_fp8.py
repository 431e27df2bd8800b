"""FP8 base models (CPU, the torch reference path): the FP8 projection, a model quantized as it
loads, and LoRA on top of it against PEFT.

Tolerances: an e4m3 value has 3 mantissa bits (a relative rounding step of 2^-4 at most), so a
quantized weight is within 1/16 of its value, and the tiny random Llama's logits move by about
2.5% (relative L2) when its weights and activations are quantized; the tests allow 5%. An
adapter's delta at a layer reads the unquantized activations, so it is PEFT's to float32 precision.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import char_tokenizer, rel_err, save_peft_adapter, tiny_llama
from torch import nn

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm import LLM
from loramux.engine.quantization import Fp8Linear, check_fp8_device, quantize_model
from loramux.errors import QuantizationError

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
INPUT = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(0))  # [B, S]
LOGITS_TOLERANCE = 0.05


def fp8_layers(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, Fp8Linear)]


def quantized_tiny_llama(dtype=torch.float32) -> nn.Module:
    model = tiny_llama().to(dtype)
    quantize_model(model)
    return model


def prompt_logprobs(llm: LLM, prompts: list[list[int]], requests: list) -> torch.Tensor:
    """``[len(prompts), len(prompt) - 1]``: each prompt token's log-prob after the ones before it
    (the prompts of one length; no prefix cache hit, whose positions get none)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           lora_request=requests, use_tqdm=False)
    return torch.tensor([[entry[t].logprob for t, entry in zip(p[1:], out.prompt_logprobs[1:])]
                         for p, out in zip(prompts, outputs)])


def peft_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """`prompt_logprobs` computed by a transformers (PEFT) model on ``ids [B, S]``."""
    with torch.no_grad():
        logprobs = model(ids).logits.float().log_softmax(-1)
    return logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].cpu()


# -- the FP8 projection ----------------------------------------------------------------------------


def test_weights_quantize_per_output_channel_within_an_fp8_rounding_step():
    torch.manual_seed(1)
    linear = nn.Linear(64, 48, bias=True)
    linear.weight.data[3] *= 100  # one channel far larger: its own scale, the others unharmed
    layer = Fp8Linear.from_linear(linear)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (48,)
    assert torch.equal(layer.weight.float().abs().amax(dim=1), torch.full((48,), 448.0))  # each row spans e4m3
    weight, deq = linear.weight.detach(), layer.dequantize()
    step = weight.abs() * 2**-4 + layer.weight_scale[:, None] * 2**-9  # relative, or subnormal absolute
    assert ((deq - weight).abs() <= step).all()
    assert torch.equal(layer.bias, linear.bias.detach())


def test_the_layer_multiplies_per_token_quantized_activations_by_its_fp8_weight():
    torch.manual_seed(2)
    linear = nn.Linear(32, 16, bias=True)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(2, 5, 32) * torch.tensor([1.0, 30.0])[:, None, None]  # two scales of tokens
    x[0, 1] = 0.0  # a token of zeros: zeros, not NaN
    # the scheme, written out: one scale per token, x / scale rounded to e4m3, float32 sums
    x_scale = (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
    x_q = (x / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    expected = x_q @ layer.dequantize().t() + linear.bias.detach()
    got = layer(x)
    assert got.shape == (2, 5, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0, 1], linear.bias.detach())
    assert rel_err(got, linear(x).detach()) < LOGITS_TOLERANCE


def compiled_calls(fn, *args) -> tuple[torch.Tensor, list]:
    """``fn(*args)`` compiled whole, and the targets of the calls in its traced graph, in order."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, [str(node.target) for node in graphs[0].graph.nodes if node.op in ("call_function", "call_method")]


def test_compiled_the_quantize_is_torch_ops_in_the_graph_and_the_gemm_one_op():
    """Traced, the layer hands its quantize to the compiler as torch ops (which inductor fuses into
    the kernel that made the activations: the RMSNorm here) and its GEMM as one opaque op."""
    torch.manual_seed(4)
    norm, layer = nn.RMSNorm(64), Fp8Linear.from_linear(nn.Linear(64, 48, bias=True))
    x = torch.randn(3, 5, 64)
    compiled, calls = compiled_calls(lambda x: layer(norm(x)), x)
    assert torch.equal(compiled, layer(norm(x)))
    assert calls.count("loramux.fp8_gemm") == 1
    assert "amax" in calls and "to" in calls  # the per-token scale and the cast to e4m3, traced


def test_a_quantized_model_keeps_embeddings_norms_and_lm_head_and_is_close_to_the_unquantized():
    base = tiny_llama()
    model = quantized_tiny_llama()
    assert fp8_layers(model) == [f"model.layers.{i}.{part}.{p}" for i in range(2)
                                 for part, names in (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:]))
                                 for p in names]
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == model.model.norm.weight.dtype == torch.float32
    with torch.no_grad():
        got, expected = model(INPUT).logits, base(INPUT).logits
    assert 0 < rel_err(got, expected) < LOGITS_TOLERANCE


def test_the_projections_take_half_the_bytes_of_bfloat16():
    base = tiny_llama().to(torch.bfloat16)
    model = quantized_tiny_llama(torch.bfloat16)
    before = sum(m.weight.nbytes for m in base.modules() if type(m) is nn.Linear and m is not base.lm_head)
    after = sum(m.weight.nbytes + m.weight_scale.nbytes for m in model.modules() if isinstance(m, Fp8Linear))
    out_channels = sum(m.out_features for m in model.modules() if isinstance(m, Fp8Linear))
    assert after == before // 2 + 4 * out_channels  # FP8 values, and a float32 scale per output channel


def test_casting_a_quantized_model_casts_its_activations_not_its_fp8_weights():
    model = quantized_tiny_llama()
    layer = model.model.layers[0].mlp.down_proj
    weight, scale = layer.weight.clone(), layer.weight_scale.clone()
    model.to(torch.bfloat16)
    assert layer.activation_dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight.view(torch.uint8), weight.view(torch.uint8)) and torch.equal(layer.weight_scale, scale)
    with torch.no_grad():
        assert model(INPUT).logits.dtype == torch.bfloat16


def test_a_gpu_without_fp8_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(QuantizationError, match=r"compute capability 8\.9 or newer.*cuda:1 \(NVIDIA A100"
                       r"-SXM4-80GB\) has compute capability 8\.0\..*without quantization='fp8'"):
        check_fp8_device("cuda:1")
    with pytest.raises(QuantizationError, match="NVIDIA A100"):
        quantize_model(tiny_llama(), "cuda:0")  # refused before any layer moves
    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        check_fp8_device("cuda:0")
    check_fp8_device("cpu")


def test_the_quantization_option_takes_fp8_or_none():
    with pytest.raises(ValueError, match=r"quantization: got 'int8'; allowed: None .* or 'fp8'"):
        LLM(tiny_llama(), quantization="int8")


def test_a_model_without_linear_projections_is_refused_rather_than_run_unquantized():
    from conftest import tiny_model

    with pytest.raises(QuantizationError, match=r"GPT2LMHeadModel has no projection to run in FP8: FP8 takes "
                                                r"plain torch\.nn\.Linear layers.*without quantization='fp8'"):
        LLM(tiny_model("gpt2"), quantization="fp8")  # transformers' Conv1D projections


# -- LoRA on the FP8 base ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def all_projections(tmp_path_factory):
    return save_peft_adapter(tiny_llama(), tmp_path_factory.mktemp("fp8") / "all", seed=21, r=8,
                             lora_alpha=16, target_modules=PROJECTIONS)


def test_an_adapters_delta_at_a_fused_layer_is_peft_delta_on_the_unquantized_activations(all_projections):
    """The first fused q/k/v reads the same activations with the adapter and without: the
    difference of its outputs is the LoRA delta alone, which PEFT computes from them."""
    from peft import PeftModel

    from loramux.engine.adapters.lora_model import LoRAModelManager
    from loramux.engine.worker.siblings import fuse_siblings
    from loramux.registry import LoRAConfig, load_adapter

    model = quantized_tiny_llama()
    fuse_siblings(model)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=1, max_lora_rank=8))
    slot = manager.activate(load_adapter(all_projections, name="all"))
    qkv = manager.layers["model.layers.0.self_attn.q_proj.siblings.fused"]
    seen = []
    qkv.register_forward_hook(lambda layer, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        for slot_of_tokens in (slot, -1):
            manager.set_mapping(torch.full((INPUT.numel(),), slot_of_tokens, dtype=torch.int32))
            model(INPUT)
    (x, with_adapter), (x_again, without) = seen
    assert torch.equal(x, x_again)
    peft_attn = PeftModel.from_pretrained(tiny_llama(), all_projections).base_model.model.model.layers[0].self_attn
    with torch.no_grad():
        expected = torch.cat([layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
                              for layer in (peft_attn.q_proj, peft_attn.k_proj, peft_attn.v_proj)], dim=-1)
        unquantized = torch.cat([layer.base_layer(x) for layer in (peft_attn.q_proj, peft_attn.k_proj,
                                                                   peft_attn.v_proj)], dim=-1)
    torch.testing.assert_close(with_adapter - without, expected, rtol=1e-5, atol=1e-6)
    assert rel_err(without, unquantized) > 1e-3  # the base output is FP8's, not the float32 layer's


def test_an_adapters_delta_on_the_fp8_base_is_close_to_peft_delta_on_the_unquantized_model(all_projections):
    from peft import PeftModel

    llm = LLM(tiny_llama(), quantization="fp8", max_loras=1, max_lora_rank=8, max_model_len=64)
    prompts = INPUT.tolist()
    base, adapted = (prompt_logprobs(llm, prompts, [lora] * len(prompts))
                     for lora in (None, LoRARequest("all", 1, str(all_projections))))
    expected_base = peft_logprobs(tiny_llama(), INPUT)
    expected_adapted = peft_logprobs(PeftModel.from_pretrained(tiny_llama(), all_projections), INPUT)
    expected_delta = expected_adapted - expected_base  # [B, S-1] log-prob deltas
    assert expected_delta.abs().mean() > 0.05  # the adapter moves the log-probs
    assert rel_err(adapted - base, expected_delta) < LOGITS_TOLERANCE  # about 2.5%: the layers' inputs are FP8's


def peft_on_fp8_base(adapter_dir) -> nn.Module:
    """PEFT running ``adapter_dir`` on the tiny Llama quantized as loramux quantizes it: every
    projection under PEFT's LoRA layers is an `Fp8Linear` (the oracle of LoRA on an FP8 base)."""
    from peft import PeftModel

    model = tiny_llama() if adapter_dir is None else PeftModel.from_pretrained(tiny_llama(), adapter_dir)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and "lora_" not in name and not name.endswith("lm_head"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8Linear.from_linear(module))
    assert len(fp8_layers(model)) == 14
    return model.eval()


def test_greedy_with_adapters_on_an_fp8_base_equals_peft_on_the_same_fp8_base(all_projections, engine_adapters):
    """A batch of base requests and two adapters through `LLM.generate` (fused q/k/v and gate/up,
    the pooled kernels, chunked prefill) against transformers' greedy generate under PEFT."""
    adapters = {"all": all_projections, "attn": engine_adapters["attn"]}
    names = [None, "all", "attn", "all", None]
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18], [40, 41], [50, 51, 52]]
    llm = LLM(tiny_llama(), quantization="fp8", max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=8)
    ids = {"all": 1, "attn": 2}
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           lora_request=[None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names],
                           use_tqdm=False)
    # q/k/v and gate/up fused, every projection wrapped for LoRA over its FP8 layer
    assert fp8_layers(llm.llm_engine.model) == [
        f"model.layers.{i}.{name}.base_layer" for i in range(2) for name in
        ("self_attn.q_proj.siblings.fused", "self_attn.o_proj", "mlp.gate_proj.siblings.fused", "mlp.down_proj")]
    oracles = {name: peft_on_fp8_base(None if name is None else adapters[name]) for name in set(names)}
    for name, prompt, out in zip(names, prompts, outputs):
        with torch.no_grad():
            expected = oracles[name].generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                              max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist(), name


def test_compiled_a_lora_layers_op_takes_the_quantized_activations_from_the_traced_code():
    """A step graph's route (the delta apart, beside the GEMM): the quantize is traced before the
    LoRA op, for inductor to fuse, and the op's GEMM reads it: the eager layer's output."""
    from test_layer_side_stream import CONFIG, SLOTS, in_graphs, with_adapters

    from loramux.engine.layers import LinearWithLoRA, Route

    torch.manual_seed(5)
    layer = with_adapters(LinearWithLoRA(Fp8Linear.from_linear(nn.Linear(16, 12)), "proj", CONFIG))
    in_graphs(layer, Route.DELTA_BESIDE)
    layer.lora_context.set(SLOTS, static=True)
    x = torch.randn(6, 16)
    compiled, calls = compiled_calls(layer, x)
    assert torch.equal(compiled, layer(x))
    assert not torch.equal(compiled, layer.base_layer(x))  # the adapters' deltas are in it
    assert calls.index("amax") < calls.index("loramux.lora_delta") and "loramux.fp8_gemm" not in calls


# -- tensor parallelism ------------------------------------------------------------------------------


def test_tensor_parallel_shards_of_fp8_layers_hold_the_whole_layers_rows_and_columns_and_scales():
    from loramux.engine.tensor_parallel.sharding import RowParallelLinear, shard_model

    whole = quantized_tiny_llama()
    shards = []
    for rank in range(2):
        model = copy.deepcopy(whole)
        shard_model(model, rank, 2)
        shards.append(model.model.layers[0])
    for block, columns, row in (("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
                                ("mlp", ("gate_proj", "up_proj"), "down_proj")):
        layers = whole.model.layers[0].get_submodule(block)
        for name in columns:  # each rank: its rows, with their scales
            parts = [shard.get_submodule(block).get_submodule(name) for shard in shards]
            assert all(isinstance(p, Fp8Linear) and p.loramux_tp.style == "column" for p in parts)
            for field in ("weight", "weight_scale"):
                assert torch.equal(torch.cat([getattr(p, field).float() for p in parts]),
                                   getattr(layers.get_submodule(name), field).float())
        parts = [shard.get_submodule(block).get_submodule(row) for shard in shards]
        assert all(isinstance(p, RowParallelLinear) and isinstance(p.linear, Fp8Linear) for p in parts)
        whole_row = layers.get_submodule(row)  # each rank: its columns, with the whole rows' scales
        assert torch.equal(torch.cat([p.linear.weight.float() for p in parts], dim=1), whole_row.weight.float())
        assert all(torch.equal(p.linear.weight_scale, whole_row.weight_scale) for p in parts)


def test_tensor_parallel_fp8_serves_adapters_as_one_rank_does(tmp_path, engine_adapters):
    """Two CPU ranks (gloo) against one. A row-parallel layer's rank quantizes its own columns
    of each token (as vLLM's do), so the log-probs agree to FP8's precision, not exactly."""
    tiny_llama().save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    requests = [None, LoRARequest("all", 1, str(engine_adapters["all"])),
                LoRARequest("attn", 2, str(engine_adapters["attn"]))]
    logprobs = []
    for tp in (1, 2):
        llm = LLM(str(tmp_path), quantization="fp8", tensor_parallel_size=tp, dtype=torch.float64, max_loras=2,
                  max_lora_rank=8, max_model_len=64)
        try:
            assert len(fp8_layers(llm.llm_engine.model)) == 8
            logprobs.append(prompt_logprobs(llm, INPUT.tolist(), requests))
        finally:
            llm.llm_engine.close()
    one, two = logprobs
    assert (one - two).abs().max() < 0.05 and not torch.equal(one, two)
