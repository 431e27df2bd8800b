"""The generation engine against its oracle: transformers + PEFT greedy generate, per request.

Tiny random Llamas on CPU; every test runs in well under a few seconds.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import assert_greedy_matches_peft, peft_greedy, resident_requests, tiny_llama, setenv

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm import LLM
from loramux.engine.llm_engine import LLMEngine
from loramux.errors import AdapterNotFoundError, IncompatibleAdapterError, LoRAError
from loramux.registry import LoRAConfig, Registry

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]


def engine(**kwargs) -> LLMEngine:
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64)
    options.update(kwargs)
    return LLMEngine(tiny_llama(), **options)


def run_to_end(engine: LLMEngine, max_steps: int = 500) -> dict[str, object]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finished


def test_mixed_batch_matches_peft_greedy(engine_adapters):
    """Base + three adapters (two slots), prompts of 1 to 30 tokens, chunked prefill, 4 rows."""
    names = [None, "attn", "all", "mlp", "attn", None, "all", "mlp"]
    ids = {"attn": 1, "all": 2, "mlp": 3}
    requests = [None if n is None else LoRARequest(n, ids[n], str(engine_adapters[n])) for n in names]
    batch = prompts(5, 17, 3, 9, 30, 1, 4, 12)
    llm = LLM(tiny_llama(), max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, lora_request=requests, use_tqdm=False)
    for name, prompt, out in zip(names, batch, outputs):
        completion = out.outputs[0]
        assert out.error is None and completion.finish_reason == "length"
        path = None if name is None else engine_adapters[name]
        assert completion.token_ids == peft_greedy(path, prompt, 10), f"adapter {name}, prompt of {len(prompt)}"


@pytest.mark.parametrize("names", [[None, "attn", "all", "mlp"], ["all", "all", "all"]], ids=["mixed", "one adapter"])
def test_a_long_prefill_with_adapters_matches_peft_greedy(names, engine_adapters, gemm_onto_delta_calls):
    """A step of more than 256 tokens runs each projection's base GEMM onto its stored delta
    (`BaseLayerWithLoRA._delta_then_gemm`): with base rows and an adapter that leaves a layer
    alone (the buffer zeroed first), and with every row written (not zeroed)."""
    batch = prompts(*[100] * len(names))
    llm = LLM(tiny_llama(), max_loras=3, max_lora_rank=8, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=512)
    requests = resident_requests(llm, names, engine_adapters, {"attn": 1, "all": 2, "mlp": 3})
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, lora_request=requests, use_tqdm=False)
    assert gemm_onto_delta_calls, "no step ran the GEMM onto its delta"
    for name, prompt, out in zip(names, batch, outputs):
        path = None if name is None else engine_adapters[name]
        assert_greedy_matches_peft(path, prompt, out.outputs[0].token_ids, name)


def test_requests_join_while_others_decode(engine_adapters):
    eng = engine(max_num_batched_tokens=8)
    attn = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    mlp = LoRARequest("mlp", 3, str(engine_adapters["mlp"]))
    early, late = prompts(6, 11, seed=2), prompts(14, 2, 7, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng.add_request("e0", {"prompt_token_ids": early[0]}, params, attn)
    eng.add_request("e1", {"prompt_token_ids": early[1]}, params)
    tokens_before = {}
    for _ in range(5):  # the early ones are decoding now
        for out in eng.step():
            tokens_before[out.request_id] = len(out.outputs[0].token_ids)
    assert tokens_before and all(n > 0 for n in tokens_before.values())
    eng.add_request("l0", {"prompt_token_ids": late[0]}, params, mlp)
    eng.add_request("l1", {"prompt_token_ids": late[1]}, params, attn)
    eng.add_request("l2", {"prompt_token_ids": late[2]}, params)
    finished = run_to_end(eng)
    expected = {
        "e0": (engine_adapters["attn"], early[0]),
        "e1": (None, early[1]),
        "l0": (engine_adapters["mlp"], late[0]),
        "l1": (engine_adapters["attn"], late[1]),
        "l2": (None, late[2]),
    }
    for request_id, (path, prompt) in expected.items():
        assert finished[request_id].outputs[0].token_ids == peft_greedy(path, prompt, 12), request_id


def test_adapter_failing_validation_fails_only_its_request(engine_adapters, make_adapter):
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY_LLAMA

    wider = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 96})).eval()
    bad = make_adapter("wider", model=wider)
    eng = engine()
    batch = prompts(4, 6, 5)
    eng.add_request("good", {"prompt_token_ids": batch[0]}, GREEDY, LoRARequest("attn", 1, str(engine_adapters["attn"])))
    eng.add_request("bad", {"prompt_token_ids": batch[1]}, GREEDY, LoRARequest("wider", 7, str(bad)))
    eng.add_request("missing", {"prompt_token_ids": batch[2]}, GREEDY, LoRARequest("nowhere", 8, "/does/not/exist"))
    eng.add_request("base", {"prompt_token_ids": batch[2]}, GREEDY)
    finished = run_to_end(eng)
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert isinstance(finished["bad"].error, IncompatibleAdapterError) and "wider" in str(finished["bad"].error)
    assert isinstance(finished["missing"].error, AdapterNotFoundError)
    assert finished["good"].outputs[0].token_ids == peft_greedy(engine_adapters["attn"], batch[0], 10)
    assert finished["base"].outputs[0].token_ids == peft_greedy(None, batch[2], 10)
    assert finished["good"].error is None and finished["base"].error is None


def test_stops_eos_stop_token_max_tokens_and_max_model_len():
    prompt = prompts(5)[0]
    reference = peft_greedy(None, prompt, 12)
    model = tiny_llama()
    model.generation_config.eos_token_id = reference[3]
    first_eos = reference.index(reference[3])
    eng = LLMEngine(model, enable_lora=False, max_num_seqs=4, max_model_len=12)
    p = {"prompt_token_ids": prompt}
    eng.add_request("eos", p, SamplingParams(temperature=0, max_tokens=12))
    eng.add_request("ignore", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.add_request("stop_id", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[reference[1]]))
    eng.add_request("model_len", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    out = {k: v.outputs[0] for k, v in run_to_end(eng).items()}
    assert (out["eos"].token_ids, out["eos"].finish_reason) == (reference[: first_eos + 1], "stop")
    assert (out["ignore"].token_ids, out["ignore"].finish_reason) == (reference[:6], "length")
    first_stop = reference.index(reference[1])
    assert out["stop_id"].token_ids == reference[: first_stop + 1]
    assert (out["stop_id"].finish_reason, out["stop_id"].stop_reason) == ("stop", reference[1])
    assert (out["model_len"].token_ids, out["model_len"].finish_reason) == (reference[:7], "length")
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("too_long", {"prompt_token_ids": list(range(3, 15))}, GREEDY)


def test_adapter_loads_beside_the_step_loop(engine_adapters):
    """A slow adapter source delays only its own request; base requests decode meanwhile."""

    release = threading.Event()

    class SlowRegistry(Registry):
        def _load(self, name, **kwargs):  # the read of a load
            release.wait(10)
            return super()._load(name, **kwargs)

    eng = engine(registry=SlowRegistry(LoRAConfig(max_loras=2, max_lora_rank=8)))
    slow = LoRARequest("attn", 1, str(engine_adapters["attn"]))
    a, b = prompts(4, 5, seed=4)
    eng.add_request("slow", {"prompt_token_ids": a}, GREEDY, slow)
    eng.add_request("base", {"prompt_token_ids": b}, GREEDY)
    seen = {}
    for _ in range(20):
        for out in eng.step():
            seen[out.request_id] = out
        if "base" in seen and len(seen["base"].outputs[0].token_ids) == 6:
            break
    assert "slow" not in seen and len(seen["base"].outputs[0].token_ids) == 6
    release.set()
    finished = run_to_end(eng)
    assert finished["slow"].outputs[0].token_ids == peft_greedy(engine_adapters["attn"], a, 10)


def test_resolver_exception_fails_only_its_request():
    class BrokenRegistry(Registry):
        def _load(self, name, **kwargs):
            raise RuntimeError("the bucket is on fire")

    eng = engine(registry=BrokenRegistry(LoRAConfig(max_loras=2, max_lora_rank=8)))
    a, b = prompts(4, 5, seed=5)
    eng.add_request("broken", {"prompt_token_ids": a}, GREEDY, LoRARequest("x", 1))
    eng.add_request("base", {"prompt_token_ids": b}, GREEDY)
    finished = run_to_end(eng)
    error = finished["broken"].error
    assert isinstance(error, LoRAError) and "bucket is on fire" in str(error) and "'x'" in str(error)
    assert finished["base"].outputs[0].token_ids == peft_greedy(None, b, 10)


def test_abort_and_duplicate_ids():
    eng = engine()
    a, b = prompts(4, 5, seed=6)
    eng.add_request("a", {"prompt_token_ids": a}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    eng.add_request("b", {"prompt_token_ids": b}, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", {"prompt_token_ids": a}, GREEDY)
    eng.step()
    eng.abort_request("a")
    finished = run_to_end(eng)
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert finished["b"].outputs[0].token_ids == peft_greedy(None, b, 10)
    assert eng.block_manager.num_free_blocks == eng.kv_cache.num_blocks - 1  # every block came back


@pytest.mark.parametrize("bad_id", [-1, 128, 99999])  # tiny_llama's vocabulary is 0..127
def test_token_ids_outside_the_vocabulary_are_refused_up_front(bad_id):
    eng = engine(enable_lora=False)
    (good,) = prompts(5, seed=8)
    eng.add_request("good", {"prompt_token_ids": good}, GREEDY)
    with pytest.raises(ValueError, match=f"token id {bad_id} is outside the vocabulary \\(0 to 127\\)"):
        eng.add_request("bad", {"prompt_token_ids": [5, bad_id]}, GREEDY)
    finished = run_to_end(eng)  # the engine and the other request are unharmed
    assert set(finished) == {"good"}
    assert finished["good"].outputs[0].token_ids == peft_greedy(None, good, 10)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy():
    eng = engine(enable_lora=False)
    p = {"prompt_token_ids": prompts(6, seed=7)[0]}
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=8, seed=123, ignore_eos=True)
    eng.add_request("s1", p, seeded)
    eng.add_request("other", p, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    eng.add_request("top1", p, SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True))
    first = run_to_end(eng)
    eng.add_request("s2", p, seeded)  # alone in its batch this time
    second = run_to_end(eng)
    assert first["s1"].outputs[0].token_ids == second["s2"].outputs[0].token_ids
    assert first["top1"].outputs[0].token_ids == peft_greedy(None, p["prompt_token_ids"], 8)


def test_lora_admin_add_pin_list_remove(engine_adapters):
    eng = engine(max_loras=2)
    eng.add_lora(LoRARequest("attn", 1, str(engine_adapters["attn"])))
    eng.add_lora(LoRARequest("mlp", 3, str(engine_adapters["mlp"])))
    assert {"attn", "mlp"} <= set(eng.list_loras())
    assert eng.pin_lora("attn") and eng.lora_manager.slot_of("attn") is not None
    p = prompts(5, seed=8)[0]
    # a request by name only: the registry knows the path from add_lora
    eng.add_request("r", {"prompt_token_ids": p}, GREEDY, LoRARequest("mlp", 3))
    finished = run_to_end(eng)
    assert finished["r"].outputs[0].token_ids == peft_greedy(engine_adapters["mlp"], p, 10)
    assert eng.remove_lora(3) and eng.remove_lora("attn")
    assert eng.lora_manager.resident() == []


@pytest.mark.parametrize("model_type", ["qwen2", "mistral", "gemma"])
def test_other_architectures_match_transformers(model_type):
    """The attention hook works for Qwen2 (biases), Mistral (sliding window) and Gemma."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY_LLAMA

    extra = {"mistral": {"sliding_window": 6}, "gemma": {"head_dim": 8}}.get(model_type, {})
    config = AutoConfig.for_model(model_type, **TINY_LLAMA, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()  # the engine changes its config
    model.load_state_dict(reference.state_dict())
    batch = prompts(3, 13, 9, seed=9)
    eng = LLMEngine(model, enable_lora=False, max_num_seqs=2, max_model_len=40, max_num_batched_tokens=8)
    for i, p in enumerate(batch):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    finished = run_to_end(eng)
    for i, p in enumerate(batch):
        assert finished[str(i)].outputs[0].token_ids == peft_greedy(None, p, 10, model=reference), (model_type, i)


def test_lora_modules_are_registered_at_start(engine_adapters):
    llm = LLM(tiny_llama(), max_lora_rank=8, max_num_seqs=2, max_model_len=32,
              lora_modules=[f"all={engine_adapters['all']}"])
    assert "all" in llm.llm_engine.list_loras()
    p = prompts(4, seed=10)[0]
    out = llm.generate({"prompt_token_ids": p}, GREEDY, lora_request=LoRARequest("all", 1), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == peft_greedy(engine_adapters["all"], p, 10)


# -- CUDA-graph pieces that run on the CPU ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_static_lora_meta_matches_the_exact_layout(seed):
    """build_lora_meta(static=True) (no host sync, for graph capture) lays the tokens out as
    the exact build does, with its worst-case tile count bounding the real one."""
    from loramux.kernels import build_lora_meta

    gen = torch.Generator().manual_seed(seed)
    S, T = 5, 23
    token_slots = torch.randint(-1, 3, (T,), generator=gen)  # at most 3 distinct slots
    token_slots[-4:] = -1  # padding tokens of a graph's bucket
    exact = build_lora_meta(token_slots, S)
    static = build_lora_meta(token_slots, S, static=True)
    assert static.static and not exact.static
    assert torch.equal(static.sorted_token_ids, exact.sorted_token_ids)
    for name in ("active_slots", "active_counts", "active_starts"):
        assert torch.equal(getattr(static, name)[:S], getattr(exact, name)), name
    # past the slots: a valid slot with no tokens (where the kernels' surplus tiles land)
    assert static.active_slots.numel() > 32 and int(static.active_slots[S:].max()) < S
    assert int(static.active_counts[S:].abs().sum()) == 0
    for block_m in (16, 32, 64):
        assert static.num_tiles(block_m) >= exact.num_tiles(block_m)


@pytest.mark.parametrize("block", [16, 64])
def test_static_meta_through_the_kernels_matches_the_exact_meta(block, monkeypatch):
    """Triton kernels (interpreter on the CPU) with a static meta, grids sized for the worst case:
    the surplus tiles change nothing, padding tokens (slot -1) stay untouched."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 before triton loads")
    from loramux.kernels import build_lora_meta, lora_expand, lora_shrink

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(block)
    S, T, H, R, out = 6, 20, 48, 8, (24, 40)
    x = torch.randn(T, H, generator=gen).to(device)
    A = torch.randn(S, 2 * R, H, generator=gen).to(device)
    B = torch.randn(S, sum(out), R, generator=gen).to(device)
    scales = torch.rand(S, 2, generator=gen).to(device)
    ranks = torch.tensor([8, 0, 5, 8, 3, 8], dtype=torch.int32, device=device)
    A[2, 5:R] = A[2, R + 5 :] = 0  # zero padding past each slot's rank, as the layers keep it
    B[2, :, 5:] = 0
    A[4, 3:R] = A[4, R + 3 :] = 0
    B[4, :, 3:] = 0
    slots = torch.tensor([2, 4, -1, 2, 0, 0, 4, -1] + [2] * 8 + [-1] * 4, device=device)  # 3 slots
    y0 = torch.randn(T, sum(out), generator=gen).to(device)
    results = []
    for kernels, meta in (("torch", build_lora_meta(slots, S)), ("triton", build_lora_meta(slots, S, static=True))):
        setenv(monkeypatch, "LORAMUX_KERNELS", kernels)
        y = y0.clone()
        buf = lora_shrink(x, A, scales, meta, ranks)
        lora_expand(y, buf, B, out, meta, ranks)
        results.append(y)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(results[1][slots < 0], y0[slots < 0])


def test_enforce_eager_is_accepted_and_the_cpu_runs_eagerly():
    llm = LLM(tiny_llama(), enable_lora=False, max_num_seqs=2, max_model_len=32, enforce_eager=True)
    assert not llm.llm_engine.runner.use_graphs
    llm = LLM(tiny_llama(), enable_lora=False, max_num_seqs=2, max_model_len=32)
    assert not llm.llm_engine.runner.use_graphs  # graphs are for CUDA only
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and llm.llm_engine.runner.graph_steps == 0


def test_graph_batch_sizes():
    from loramux.engine.worker.model_runner import graph_batch_sizes

    assert graph_batch_sizes(64) == [2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(4) == [2, 4] and graph_batch_sizes(1) == [2]
    assert graph_batch_sizes(40) == [2, 4, 8, 16, 32, 40]


def test_a_hanging_adapter_load_does_not_keep_the_process_alive():
    import subprocess
    import sys

    script = """
import threading, types
from loramux.engine.adapters.loading import AdapterLoader
from loramux.registry import LoRAConfig, LoRARequest, Registry
from loramux.resolvers import Resolver

class Silent(Resolver):  # a resolver that never answers
    name = "silent"
    def resolve(self, base_model_name, lora_name):
        threading.Event().wait()

registry = Registry(LoRAConfig(), resolvers=[Silent()])
loader = AdapterLoader(registry, check=lambda adapter: None, on_settled=lambda *args: None)
loader.submit(types.SimpleNamespace(lora_name="stuck", lora_request=LoRARequest("stuck", 1)))
loader.shutdown()
print("exiting")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "exiting", result.stderr


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_aborted_while_queued_never_runs(async_scheduling):
    """Aborted before any step admitted it: it finishes with "abort" and no token, and the engine
    is empty (it used to be admitted in the same step, and ran to max_tokens)."""
    eng = LLMEngine(tiny_llama(), enable_lora=False, max_num_seqs=4, max_model_len=64, async_scheduling=async_scheduling)
    eng.add_request("queued", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    eng.add_request("kept", {"prompt_token_ids": [8, 9]}, GREEDY)
    eng.abort_request("queued")
    outputs = {}
    for _ in range(40):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            outputs[out.request_id] = out
    assert outputs["queued"].finished and outputs["queued"].outputs[0].finish_reason == "abort"
    assert outputs["queued"].outputs[0].token_ids == []
    assert len(outputs["kept"].outputs[0].token_ids) == 10 and not eng.scheduler.running and not eng.scheduler.waiting
