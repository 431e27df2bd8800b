"""The start-up kernel warm-up: its plan reaches every launch configuration of the
candidate steps, and running it changes nothing a request could see.

The plan is host-only arithmetic over the kernels' own config functions, so it is checked here
with the 8B model's shapes and an H100's SM count; running it is checked on the tiny model (the
torch reference path on CPU: the same runner code, no Triton launch).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, setenv
from loramux import LoRARequest, SamplingParams
from loramux.engine.worker import kernel_warmup
from loramux.engine.worker.kernel_warmup import LoRAModuleShape, WarmupStep, plan_warmup, run_warmup, warm_up_kernels
from loramux.engine.layers import BaseLayerWithLoRA
from loramux.engine.llm_engine import LLMEngine
from loramux.kernels import attention, build_lora_meta, expand, shrink
from loramux.kernels.tiles import next_pow2

H100_PROGRAMS = 2 * 132  # tiles.target_programs on an H100 (132 SMs)
R, SLOTS = 16, 8
EIGHT_B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
               device=torch.device("cpu"))
# Llama-3.1-8B's LoRA layers on the fused layout: qkv, o, gate_up, down
MODULES = [
    LoRAModuleShape(3 * R, 4096, (4096, 1024, 1024), R, torch.bfloat16),
    LoRAModuleShape(R, 4096, (4096,), R, torch.bfloat16),
    LoRAModuleShape(2 * R, 4096, (14336, 14336), R, torch.bfloat16),
    LoRAModuleShape(R, 14336, (4096,), R, torch.bfloat16),
]


@pytest.fixture
def h100_heuristics(monkeypatch):
    """The launch heuristics as on an H100 (on CPU they size grids for 4 programs)."""
    for module in (shrink, expand, attention):
        monkeypatch.setattr(module, "target_programs", lambda device, sms=None: 2 * sms if sms else H100_PROGRAMS)
    attention.attention_config.cache_clear()
    yield
    attention.attention_config.cache_clear()


def test_plan_reaches_every_shrink_expand_and_attention_config(h100_heuristics):
    max_tokens = 2048
    plan, reached = plan_warmup(max_num_batched_tokens=max_tokens, max_num_seqs=64, lora_modules=MODULES,
                                num_slots=SLOTS, **EIGHT_B)
    shrinks = {(key[1], key[4], key[5]) for key in reached if key[0] == "shrink"}
    expands = {(key[1], key[4]) for key in reached if key[0] == "expand"}
    attentions = {key[1:] for key in reached if key[0] == "attention"}
    device = EIGHT_B["device"]
    for T in range(1, max_tokens + 1):  # every token count a step of one adapter can have
        meta = build_lora_meta(torch.zeros(T, dtype=torch.int32), SLOTS)
        for m in MODULES:
            launch = shrink.shrink_launch(meta, m.stacked_rank, m.in_features, m.dtype, device)
            assert (m.stacked_rank, launch.config, launch.split_k) in shrinks, f"shrink at T={T}, {m}"
            assert (m.slice_sizes, expand.expand_config(meta, m.slice_sizes, R, m.dtype, device)) in expands
        for B in range(1, min(T, 64) + 1, 1 if T % 97 == 0 else 63):  # every sequence count, at some T
            width = -(-(T - B + 1) // 16)
            cfg = attention.attention_config(max(T, 2), B, 32, 8, 128, width, 16, torch.bfloat16, device)
            assert (cfg, max(16, next_pow2(B))) in attentions, f"attention at T={T}, B={B}"
    # one step per new launch configuration, far fewer than the token counts
    assert len(plan) <= len(reached) < max_tokens // 10
    assert all(step.lora for step in plan)
    assert {s.num_seqs for s in plan} >= {1, 2, 17, 33}  # each padded sequence count (16, 32, 64) of mixed steps


def test_plan_reaches_every_kernel_of_prefill_steps_with_many_adapters(h100_heuristics):
    """Steps past the graphs mixing many adapters launch only kernels the one-adapter plan
    compiled: were their launch shapes to follow their segments, a trace of many adapters would
    compile kernels mid-serving, each a step lasting seconds."""
    slots, max_tokens = 256, 4096
    _, reached = plan_warmup(max_num_batched_tokens=max_tokens, max_num_seqs=64, lora_modules=MODULES,
                             num_slots=slots, min_tokens=513, **EIGHT_B)
    device, rng = EIGHT_B["device"], torch.Generator().manual_seed(0)
    for _ in range(100):  # prompts of several adapters (some base), decodes of others
        lengths = torch.randint(1, 600, (int(torch.randint(1, 24, (1,), generator=rng)),), generator=rng)
        owners = torch.randint(-1, slots, (len(lengths),), generator=rng)
        token_slots = torch.cat([torch.full((int(n),), int(o)) for n, o in zip(lengths, owners)]
                                + [torch.randint(-1, slots, (int(torch.randint(0, 64, (1,), generator=rng)),),
                                                 generator=rng)])[:max_tokens]
        if token_slots.numel() <= 512:
            continue
        meta = build_lora_meta(token_slots.to(torch.int32), slots)
        lanes = kernel_warmup.slot_lanes(meta)
        for m in MODULES:
            launch = shrink.shrink_launch(meta, m.stacked_rank, m.in_features, m.dtype, device)
            key = ("shrink", m.stacked_rank, m.in_features, m.dtype, launch.config, launch.split_k, lanes)
            assert key in reached, f"T={meta.num_tokens}, {meta.num_active} adapters: {key}"
            cfg = expand.expand_config(meta, m.slice_sizes, R, m.dtype, device)
            assert ("expand", m.slice_sizes, R, m.dtype, cfg, lanes) in reached


def test_plan_past_the_graphs_reaches_attention_at_every_sequence_count(h100_heuristics):
    """A step of 517 tokens over 9 sequences needs an attention kernel of its own: a plan standing
    B = 2 for every B of 2..16 would miss it, as `attention_config` takes shorter query blocks as
    B grows."""
    _, reached = plan_warmup(max_num_batched_tokens=2048, max_num_seqs=64, min_tokens=513, **EIGHT_B)
    attentions = {key[1:] for key in reached if key[0] == "attention"}
    for T in range(513, 2049, 7):
        for B in range(1, 65):
            width = -(-(T - B + 1) // 16)
            cfg = attention.attention_config(T, B, 32, 8, 128, width, 16, torch.bfloat16, EIGHT_B["device"])
            assert (cfg, max(16, next_pow2(B))) in attentions, f"attention at T={T}, B={B}"


def test_plan_without_lora_has_attention_keys_only(h100_heuristics):
    plan, reached = plan_warmup(max_num_batched_tokens=512, max_num_seqs=8, **EIGHT_B)
    assert {key[0] for key in reached} == {"attention"}
    assert not any(step.lora for step in plan)
    assert plan[0] == WarmupStep(1, 1, False)


def test_an_eager_fp8_plan_reaches_each_block_height_of_the_decode_sized_gemm(h100_heuristics):
    _, without = plan_warmup(max_num_batched_tokens=512, max_num_seqs=8, **EIGHT_B)
    plan, reached = plan_warmup(max_num_batched_tokens=512, max_num_seqs=8, fp8=True, **EIGHT_B)
    assert {key for key in reached if key[0] == "fp8_gemm"} == {("fp8_gemm", rows) for rows in (16, 32, 64)}
    assert reached - without == {("fp8_gemm", rows) for rows in (16, 32, 64)}
    # past the graphs' sizes (64 tokens and more) no step runs it
    assert not any(key[0] == "fp8_gemm" for key in plan_warmup(max_num_batched_tokens=512, max_num_seqs=8,
                                                               min_tokens=65, fp8=True, **EIGHT_B)[1])


def test_plan_leaves_the_steps_graphs_serve_to_them(h100_heuristics):
    everything, _ = plan_warmup(max_num_batched_tokens=1024, max_num_seqs=8, **EIGHT_B)
    eager, reached = plan_warmup(max_num_batched_tokens=1024, max_num_seqs=8, min_tokens=513, **EIGHT_B)
    assert eager and min(step.num_tokens for step in eager) >= 513
    assert len(eager) < len(everything)
    assert plan_warmup(max_num_batched_tokens=512, max_num_seqs=8, min_tokens=513, **EIGHT_B) == ([], set())


def engine() -> LLMEngine:
    return LLMEngine(tiny_llama(), enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4,
                     max_model_len=64, max_num_batched_tokens=32)


def greedy(eng: LLMEngine, lora: LoRARequest) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": prompt}, params, lora if i else None)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    return [outs[str(i)] for i in range(len(prompts))]


def test_warm_up_runs_each_planned_step_and_leaves_no_trace(engine_adapters, monkeypatch):
    lora = LoRARequest("all", 1, str(engine_adapters["all"]))
    expected = greedy(engine(), lora)
    eng = engine()
    runner, manager = eng.runner, eng.lora_manager
    forwards, lora_rows = [], []
    real_forward, real_apply = runner._model_forward, BaseLayerWithLoRA.apply_lora
    monkeypatch.setattr(runner, "_model_forward", lambda ids, *a: forwards.append(len(ids)) or real_forward(ids, *a))

    def apply(layer, x, y, meta):
        lora_rows.append(meta.num_tokens)
        real_apply(layer, x, y, meta)

    monkeypatch.setattr(BaseLayerWithLoRA, "apply_lora", apply)
    plans = []
    real_plan = kernel_warmup.plan_warmup
    monkeypatch.setattr(kernel_warmup, "plan_warmup", lambda **kw: plans.append(real_plan(**kw)[0]) or (plans[-1], None))
    stats = (manager.stats.hits, manager.stats.misses, manager.stats.loads)
    steps = warm_up_kernels(runner)  # the runner calls it on CUDA only; the CPU path runs the same steps

    plan = plans[0]
    assert steps == len(plan) > 1 and all(step.lora for step in plan)
    assert forwards == [step.padded_tokens for step in plan]  # each planned step ran, once
    # the LoRA layers ran in every step (a zero adapter held a slot), not only the base layers
    assert set(lora_rows) == set(forwards)
    assert manager.resident() == [] and (manager.stats.hits, manager.stats.misses, manager.stats.loads) == stats
    assert not runner.kv.k.any() and not runner.kv.v.any()  # nothing written to the cache
    monkeypatch.undo()
    assert greedy(eng, lora) == expected


def test_warm_up_on_an_engine_that_wraps_some_projections_only(engine_adapters):
    """Its zero adapter covers the wrapped projections only: with lora_target_modules=q/v the fused
    qkv layer holds a k slice no adapter may target, and an 8B engine so configured failed to start
    on CUDA (the warm-up's adapter targeted k_proj)."""
    lora = LoRARequest("attn", 1, str(engine_adapters["attn"]))  # q/v
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64,
                   max_num_batched_tokens=32, lora_target_modules=["q_proj", "v_proj"])
    expected = greedy(LLMEngine(tiny_llama(), **options), lora)
    eng = LLMEngine(tiny_llama(), **options)
    assert warm_up_kernels(eng.runner) > 1  # the runner calls it on CUDA only; the CPU path runs the same steps
    assert eng.lora_manager.resident() == []
    assert greedy(eng, lora) == expected


def test_with_no_step_to_warm_the_slot_write_still_builds_its_kernel(monkeypatch):
    """When graphs serve every step the plan is empty, and the zero adapter's slot write is what
    builds the copy kernel each later slot write launches: it is still written and left."""
    eng = engine()
    manager = eng.lora_manager
    written = []
    real_activate = manager.activate
    monkeypatch.setattr(manager, "activate", lambda adapter: written.append(adapter.name) or real_activate(adapter))
    monkeypatch.setattr(eng.runner, "_model_forward", lambda *a: pytest.fail("no step is planned"))
    assert run_warmup(eng.runner, []) == 0
    assert written == [kernel_warmup.WARMUP_ADAPTER] and manager.resident() == []


def test_warm_up_can_be_switched_off(monkeypatch):
    eng = engine()
    setenv(monkeypatch, kernel_warmup.ENV_VAR, "0")
    monkeypatch.setattr(eng.runner, "_model_forward", lambda *a: pytest.fail("no step runs when switched off"))
    assert warm_up_kernels(eng.runner) == 0


def test_warm_up_is_skipped_where_no_triton_kernel_runs(monkeypatch):
    eng = engine()  # CPU: the torch reference kernels, nothing to compile
    monkeypatch.setattr(kernel_warmup, "warm_up_kernels", lambda runner: pytest.fail("not on CPU"))
    eng.runner.warm_up_kernels()
    assert "warmup" not in eng.runner.startup_seconds


def test_a_planning_failure_skips_the_warm_up_with_a_warning(monkeypatch, caplog):
    eng = engine()

    def broken(**kwargs):
        raise TypeError("attention_config() got an unexpected keyword argument")

    monkeypatch.setattr(kernel_warmup, "plan_warmup", broken)
    monkeypatch.setattr(eng.runner, "_model_forward", lambda *a: pytest.fail("no step runs without a plan"))
    with caplog.at_level("WARNING", logger="loramux.engine.worker.kernel_warmup"):
        assert warm_up_kernels(eng.runner) == 0
    assert "kernel warm-up skipped" in caplog.text and "TypeError" in caplog.text
    assert "LORAMUX_KERNEL_WARMUP=0" in caplog.text


def test_the_parallel_pass_turns_every_launch_into_a_compile_only_warmup(monkeypatch):
    from triton.runtime.jit import JITFunction

    calls = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: calls.append(warmup))
    steps = []

    class Runner:  # each step "launches" one kernel the way a launcher does: kernel[grid](...)
        def _forward_packed(self, **inputs):
            steps.append(len(inputs["ids"]))
            JITFunction.run(None, grid=(1,), warmup=False)

    plan = [WarmupStep(3), WarmupStep(9, 2)]
    monkeypatch.setattr(kernel_warmup, "_run_step", lambda runner, step, slot: runner._forward_packed(
        ids=[0] * step.num_tokens))
    patched = JITFunction.run
    setenv(monkeypatch, kernel_warmup.THREADS_ENV_VAR, "4")
    kernel_warmup._compile_in_parallel(Runner(), plan, None)
    assert steps == [3, 9] and calls == [True, True]  # compile-only: nothing launched
    assert JITFunction.run is patched  # launches launch again afterwards

    setenv(monkeypatch, kernel_warmup.THREADS_ENV_VAR, "1")  # one thread: no separate pass
    kernel_warmup._compile_in_parallel(Runner(), plan, None)
    assert steps == [3, 9]
