"""Regional compilation: one compiled graph serves every decoder layer and every token
count, and equals eager; the compile caches go where they should.

On CPU with dynamo's ``aot_eager`` backend (no C++ codegen): what is proved here is dynamo's side,
which decides how many graphs there are; inductor only lowers each of them.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_LLAMA, needs_cuda, setenv
from loramux import LoRARequest, SamplingParams
from loramux.engine.worker.compilation import (compile_repeated_blocks, configure_compile_caches, repeated_blocks,
                                        restore_eager_blocks)
from loramux.engine.llm_engine import LLMEngine

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# prompts of several lengths: prefill steps of several token counts, decode steps beside them
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5], list(range(10, 27)), [40, 41]]


def llama(num_layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": num_layers})).eval().double()


def generate(engine: LLMEngine, lora: LoRARequest) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(PROMPTS):  # base and adapter rows mixed in every step
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, lora if i % 2 else None)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    return outputs


# dynamo alone decides how many frames there are ("eager"); "aot_eager" also runs the custom ops
# through AOTAutograd's functionalization, as inductor does (slower: once)
@pytest.mark.parametrize(("num_layers", "backend"), [(2, "aot_eager"), (4, "eager")])
def test_one_compiled_frame_serves_every_layer_and_token_count(num_layers, backend, make_adapter):
    torch._dynamo.reset()
    adapter = make_adapter(f"all{num_layers}", model=llama(num_layers).float(), seed=3, r=4,
                           target_modules=ALL_PROJECTIONS)
    lora = LoRARequest("all", 1, str(adapter))
    engine = LLMEngine(llama(num_layers), enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4,
                       max_model_len=64, max_num_batched_tokens=16)
    eager = generate(engine, lora)

    counter = CompileCounterWithBackend(backend)
    regions = compile_repeated_blocks(engine.model, backend=counter)
    assert len(regions.blocks) == num_layers
    compiled = generate(engine, lora)

    # the layer ints the custom ops take, and the token count, are graph inputs: one frame in all
    assert counter.frame_count == 1, f"{counter.frame_count} frames for {num_layers} layers"
    assert regions.frames == 1 and regions.compile_seconds > 0
    for key, out in eager.items():
        assert compiled[key].token_ids == out.token_ids, f"request {key}"
        for got, want in zip(compiled[key].logprobs, out.logprobs):
            token = next(iter(want))
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-9)

    assert restore_eager_blocks(engine.model) == num_layers
    assert generate(engine, lora) == eager and counter.frame_count == 1  # eager again: no new frame


def test_repeated_blocks_are_the_outermost_lists_of_one_class():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # inside a block: not a region

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block(), Block()])
    model.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # not repeated
    model.single = nn.ModuleList([nn.Linear(2, 2)])  # not repeated
    assert repeated_blocks(model) == list(model.layers)


def test_compiling_a_model_without_repeated_blocks_names_the_fix():
    with pytest.raises(ValueError, match=r"Linear has no repeated blocks.*compilation=False.*enforce_eager=True"):
        compile_repeated_blocks(nn.Linear(2, 2))


def unset(monkeypatch, *names: str) -> None:
    for name in names:  # set first, so monkeypatch restores the variable's absence too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_compile_caches_default_to_the_loramux_cache_dir(monkeypatch, tmp_path):
    unset(monkeypatch, "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    setenv(monkeypatch, "LORAMUX_CACHE_DIR", str(tmp_path / "lmx"))
    dirs = configure_compile_caches()
    assert dirs.inductor == tmp_path / "lmx" / "torch-compile"
    assert dirs.triton == tmp_path / "lmx" / "triton"
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    import triton

    assert cache_dir() == str(dirs.inductor)  # what inductor's FX graph and AOTAutograd caches use
    assert triton.knobs.cache.dir == str(dirs.triton)


def test_compile_caches_keep_the_users_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    dirs = configure_compile_caches(tmp_path / "lmx")
    assert (dirs.inductor, dirs.triton) == (tmp_path / "mine", tmp_path / "my-triton")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_nothing_compiles_while_serving_and_compiled_equals_eager(engine_adapters, monkeypatch, tmp_path):
    """Inductor, graphs and the kernel warm-up at start; then steps of new shapes build no dynamo
    frame and no Triton kernel, and their greedy tokens equal an eager engine's."""
    import triton

    from loramux.engine.worker.compilation import compiled_frames

    torch._dynamo.reset()  # an earlier test's compiled layer would serve this one: count from zero
    setenv(monkeypatch, "LORAMUX_CACHE_DIR", str(tmp_path))
    lora = LoRARequest("all", 1, str(engine_adapters["all"]))
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8, max_model_len=96,
                   max_num_batched_tokens=64, num_gpu_blocks_override=256)  # earlier tests' memory may be in use
    from conftest import tiny_llama

    compiled = LLMEngine(tiny_llama().cuda(), **options)
    # two frames for every layer: step graphs with adapters (the delta beside the base GEMM, added in
    # the compiled layer) and every other step (eager steps add deltas in line), both compiled at
    # start; this model has no big GEMM, so no third
    assert compiled.runner.regions.frames == 2 and compiled.runner.startup_seconds["warmup"] > 0
    built = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: built.append(kw["repr"]))
    frames = compiled_frames()
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 17, 40, 63)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(engine):
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params, lora if i % 2 else None)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return outs

    got = run(compiled)
    assert compiled_frames() == frames, "dynamo compiled while serving"
    assert built == [], f"Triton kernels built while serving: {built}"
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    assert got == run(LLMEngine(tiny_llama().cuda(), enforce_eager=True, **options))
