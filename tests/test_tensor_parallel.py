"""Tensor parallelism: the model and its adapters sharded over 2 ranks.

On CPU the ranks are 2 processes joined by gloo; the `gpu` tests run the same on 2 GPUs (NCCL).
Greedy tokens are compared in float64 (float32 on the GPU, through the compiled forward and the
graphs), where summing a layer's output over ranks cannot flip a near-tie of the random model.
Starting workers costs a few seconds (spawn), so one engine serves several tests.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import TINY_LLAMA, char_tokenizer, step_to_end, tiny_llama, tiny_model, two_gpus

from loramux import LoRARequest, SamplingParams
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.tensor_parallel.group import destroy_group, rank_device, symmetric_buffer, use_symmetric_memory
from loramux.engine.tensor_parallel.sharding import RowParallelLinear, shard_model
from loramux.engine.tensor_parallel.workers import WorkerError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
OPTIONS = dict(max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [40, 41], [50, 51, 52], [60, 61, 62, 63]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama as a model dir (a worker loads the model itself, so it needs one)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    return str(directory)


def build(model_dir, tp: int, dtype=torch.float64, device="cpu", **options) -> LLMEngine:
    return LLMEngine(model_dir, dtype=dtype, device=device, tensor_parallel_size=tp, **{**OPTIONS, **options})


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived close()"


def generate(engine: LLMEngine, requests) -> dict[str, list[int]]:
    """``requests``: ``(id, prompt, lora_request)``; step to the end, return the tokens per id."""
    for request_id, prompt, lora in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY, lora)
    return step_to_end(engine, max_steps=500)


def mixed(adapters: dict, tag: str) -> list:
    """One batch: base requests and one request per adapter, more adapters than slots."""
    names = [None, *adapters]
    return [
        (f"{tag}{i}", prompt, None if names[i % len(names)] is None
         else LoRARequest(names[i % len(names)], 1 + names.index(names[i % len(names)]),
                          str(adapters[names[i % len(names)]])))
        for i, prompt in enumerate(PROMPTS)
    ]


# -- sharding, in process ------------------------------------------------------------------------


def test_shards_hold_their_heads_and_the_config_says_so():
    model = tiny_llama()
    names = shard_model(model, rank=1, size=2)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert len(names) == 2 * 7
    assert attn.q_proj.weight.shape == (16, 32) and attn.k_proj.weight.shape == (8, 32)  # 2 of 4 heads, 1 of 2
    assert mlp.gate_proj.weight.shape == (32, 32) and isinstance(mlp.down_proj, RowParallelLinear)
    assert mlp.down_proj.linear.weight.shape == (32, 32)
    full = tiny_llama()  # same seed: rank 1 holds the second half of the rows / columns
    torch.testing.assert_close(attn.k_proj.weight, full.model.layers[0].self_attn.k_proj.weight[8:])
    torch.testing.assert_close(mlp.down_proj.linear.weight, full.model.layers[0].mlp.down_proj.weight[:, 32:])
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim) == (2, 1, 8)


def test_a_prebuilt_shard_is_marked_not_sliced_again():
    from transformers import LlamaConfig, LlamaForCausalLM

    from loramux.engine.tensor_parallel.sharding import shard_config

    config = LlamaConfig(**TINY_LLAMA)
    shard_config(config, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (2, 1, 32)
    model = LlamaForCausalLM(config)
    shard_model(model, rank=1, size=2, prebuilt=True)
    mlp = model.model.layers[1].mlp
    assert mlp.up_proj.weight.shape == (32, 32) and mlp.up_proj.loramux_tp.rank == 1
    assert mlp.down_proj.linear.weight.shape == (32, 32) and mlp.down_proj.linear.loramux_tp.style == "row"
    assert config.num_attention_heads == 2  # divided once


def test_heads_that_do_not_divide_are_refused_naming_the_count():
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's num_key_value_heads=2"):
        shard_model(tiny_llama(), rank=0, size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads=4"):
        shard_model(tiny_llama(), rank=0, size=3)
    from transformers import LlamaConfig

    from loramux.engine.tensor_parallel.sharding import shard_config

    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads=4"):
        shard_config(LlamaConfig(**TINY_LLAMA), 3)


def test_an_architecture_outside_the_mapping_is_refused():
    with pytest.raises(ValueError, match="GPT2LMHeadModel has 0 of them.*tensor_parallel_size=1"):
        shard_model(tiny_model("gpt2"), rank=0, size=2)
    fused = r"Phi3ForCausalLM has 0 of them; not plain nn.Linear .*: model.layers.0.self_attn.q_proj \(missing\)"
    with pytest.raises(ValueError, match=fused):
        shard_model(tiny_model("phi3"), rank=0, size=2)


def lora_outputs(layer: torch.nn.Module, name: str, adapter, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` with ``adapter`` on every token, the layer wrapped for LoRA as ``name``."""
    from loramux.engine.adapters.lora_model import LoRAModelManager
    from loramux.registry import LoRAConfig

    parent = torch.nn.Module()
    parent.add_module(name, layer)
    manager = LoRAModelManager(parent, LoRAConfig(max_loras=1, max_lora_rank=8))
    manager.validate(adapter)  # the whole adapter fits the shard: checked against the whole layer
    manager.activate(adapter)
    manager.set_mapping(torch.zeros(x.shape[0], dtype=torch.int32))
    with torch.no_grad():
        return getattr(parent, name)(x)


@pytest.mark.parametrize("style", ["column", "row"])
def test_sharded_lora_adds_up_to_the_whole_layers_lora(style):
    from loramux.engine.tensor_parallel.sharding import _column_shard, _row_shard
    from loramux.registry import LoRAAdapter, LoRAModuleWeights

    torch.manual_seed(0)
    full = torch.nn.Linear(16, 12, bias=False).double()
    weights = LoRAModuleWeights(torch.randn(4, 16, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64), 0.5)
    adapter = LoRAAdapter("a", Path("."), {"proj": weights}, 8, ["proj"])
    x = torch.randn(5, 16, dtype=torch.float64)
    want = lora_outputs(full, "proj", adapter, x)
    if style == "column":  # each rank its rows of the output: concatenated
        parts = [lora_outputs(_column_shard(full, rank, 2), "proj", adapter, x) for rank in range(2)]
        got = torch.cat(parts, dim=-1)
    else:  # each rank its columns of the input; the partial outputs (LoRA's included) summed
        parts = [lora_outputs(_row_shard(full, "proj", rank, 2).linear, "proj", adapter, x[:, 8 * rank : 8 * rank + 8])
                 for rank in range(2)]
        got = parts[0] + parts[1]
    torch.testing.assert_close(got, want)
    assert not torch.allclose(want, full(x))  # the adapter changes the output


def test_cpu_groups_sum_through_gloo_not_a_symmetric_buffer():
    assert not use_symmetric_memory(1 << 20, torch.bfloat16, torch.device("cpu"))
    assert symmetric_buffer() is None


def _aborting_as_nccl(monkeypatch, graphs_dropped: threading.Event, *, returns: bool) -> dict:
    """torch's NCCL abort as it behaves with a collective captured in a CUDA graph: the collectives
    stop at once, and the abort returns once the graph is dropped (or, ``returns=False``, never)."""
    from torch import distributed as dist

    state = {"open": True}

    def abort() -> None:
        if returns and graphs_dropped.wait(10):
            state["open"] = False
        else:
            threading.Event().wait(10)

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", abort)
    monkeypatch.setattr(dist, "is_initialized", lambda: state["open"])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    return state


def test_an_aborted_group_drops_the_graphs_while_the_abort_waits_for_them(monkeypatch):
    dropped = threading.Event()
    state = _aborting_as_nccl(monkeypatch, dropped, returns=True)
    start = time.monotonic()
    destroy_group(abort=True, release=dropped.set)
    assert dropped.is_set() and not state["open"]  # left, instead of waiting for graphs never dropped
    assert time.monotonic() - start < 5


def test_an_abort_that_never_returns_is_left_behind_with_a_warning(monkeypatch, caplog):
    import loramux.engine.tensor_parallel.group as group

    dropped = threading.Event()
    state = _aborting_as_nccl(monkeypatch, dropped, returns=False)
    monkeypatch.setattr(group, "ABORT_STOP_S", 0.05)
    monkeypatch.setattr(group, "ABORT_WAIT_S", 0.05)
    destroy_group(abort=True, release=dropped.set)
    assert dropped.is_set() and state["open"]  # the device memory went back all the same
    assert "cannot start another tensor-parallel engine" in caplog.text


def test_ranks_need_as_many_gpus_as_ranks_from_gpu_0():
    with pytest.raises(ValueError, match="device='cuda:1' with tensor_parallel_size=2: the ranks take cuda:0 to cuda:"):
        rank_device(torch.device("cuda:1"), 0, 2)
    if torch.cuda.device_count() < 8:
        with pytest.raises(ValueError, match=r"tensor_parallel_size=8 needs 8 GPUs, and \d+ are visible"):
            rank_device(torch.device("cuda"), 0, 8)
    assert rank_device(torch.device("cpu"), 1, 2) == torch.device("cpu")


# -- two processes over gloo ----------------------------------------------------------------------


def test_a_failed_start_raises_the_cause_and_leaves_no_worker(model_dir):
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(OSError, match="no-such-model"):  # the driver's own load fails; its worker's too
        build(os.path.join(model_dir, "no-such-model"), 2)
    assert {p.pid for p in multiprocessing.active_children()} == before


def test_workers_exit_when_their_driver_dies(model_dir):
    script = (
        "import os, sys, torch\n"
        "from loramux.engine.llm_engine import LLMEngine\n"
        "if __name__ == '__main__':\n"
        f"    e = LLMEngine({model_dir!r}, device='cpu', tensor_parallel_size=2, max_model_len=64)\n"
        "    print(*e.workers.pids, flush=True)\n"
        "    os._exit(0)  # no close(), no atexit: as if killed\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 1, done.stderr[-2000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.1)
    assert_gone(pids)



def test_a_killed_worker_fails_the_step_at_once_and_close_leaves_no_process(tmp_path):
    # a random-weight model from a config: each rank builds only its share (shard_config)
    config_file = tmp_path / "tiny.json"
    config_file.write_text(json.dumps({"model_type": "llama", **TINY_LLAMA}))
    engine = build(str(config_file), 2, load_format="dummy", max_model_len=128)
    q_proj = engine.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.shape == (16, 32) and engine.kv_cache.num_kv_heads == 1  # 2 of 4 heads, 1 of 2
    pids = engine.workers.pids
    engine.add_request("long", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died during .*close it and start a new one"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - started < 5
    with pytest.raises(WorkerError, match="died"):  # the engine stays failed, loudly
        engine.step()
    engine.close()
    assert_gone(pids)


class TestOneSharedEngine:
    """One TP=2 engine for these tests, closed when they end: one tensor-parallel engine is open
    per process at a time, and the tests before and after build their own."""

    @pytest.fixture(scope="class")
    @classmethod
    def tp_engine(cls, model_dir):
        engine = build(model_dir, 2, async_scheduling=True)  # off by default on CPU: the path on test
        pids = engine.workers.pids
        yield engine
        engine.close()
        assert_gone(pids)

    def test_tp2_greedy_equals_tp1_for_base_and_adapter_requests_in_one_batch(
        self, model_dir, tp_engine, engine_adapters
    ):
        reference = build(model_dir, 1)
        expected = generate(reference, mixed(engine_adapters, "m"))
        reference.close()
        assert len(set(map(tuple, expected.values()))) > 3  # the adapters change the output
        # async steps: each decode's token id is still on the device, on every rank rank 0's
        assert tp_engine.async_scheduling
        assert generate(tp_engine, mixed(engine_adapters, "m")) == expected

    def test_the_kernel_warm_up_runs_each_step_on_every_rank_with_a_whole_zero_adapter(self, tp_engine):
        """The warm-up's zero adapter has the whole layers' shapes, split for each rank as any
        adapter is, and each of its steps runs on both ranks (their all-reduces pair up)."""
        import dataclasses

        from loramux.engine.worker.kernel_warmup import WARMUP_ADAPTER, WarmupStep, run_warmup

        manager = tp_engine.lora_manager
        stats = dataclasses.asdict(manager.stats)
        plan = [WarmupStep(12, lora=True), WarmupStep(9, num_seqs=3, lora=True), WarmupStep(4, num_seqs=4)]
        assert run_warmup(tp_engine.runner, plan) == 3
        assert manager.slot_of(WARMUP_ADAPTER) is None and dataclasses.asdict(manager.stats) == stats
        out = generate(tp_engine, [("warmed", PROMPTS[0], None)])  # and it serves on, on both ranks
        assert len(out["warmed"]) == GREEDY.max_tokens

    def test_a_second_tensor_parallel_engine_in_the_process_is_refused_before_spawning(self, model_dir, tp_engine):
        with pytest.raises(RuntimeError, match=r"process group is already open in this process.*close\(\) that engine"):
            build(model_dir, 2)

    def test_adapters_load_unload_and_reload_while_requests_run(
        self, model_dir, tp_engine, engine_adapters, make_adapter
    ):
        replacement = make_adapter("attn-v2", seed=99, r=8, target_modules=["q_proj", "o_proj", "up_proj"])
        first = [("a0", PROMPTS[0], LoRARequest("attn", 1, str(engine_adapters["attn"]))), ("b0", PROMPTS[1], None)]
        later = [("a1", PROMPTS[2], LoRARequest("new", 7, str(replacement))),
                 ("b1", PROMPTS[3], LoRARequest("all", 2, str(engine_adapters["all"])))]

        def scenario(engine: LLMEngine) -> dict[str, list[int]]:
            for request_id, prompt, lora in first:
                engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY, lora)
            for _ in range(3):
                engine.step()
            engine.add_lora(LoRARequest("new", 7, str(replacement)))  # loaded while "a0" decodes
            done = generate(engine, later)
            done.update(generate(engine, []))
            assert engine.remove_lora("new") and engine.remove_lora("all")  # frees slots on every rank
            done.update(generate(engine, [("a2", PROMPTS[4], LoRARequest("attn", 1, str(engine_adapters["attn"])))]))
            return done

        reference = build(model_dir, 1)
        expected = scenario(reference)
        reference.close()
        assert scenario(tp_engine) == expected
        assert set(expected) == {"a0", "b0", "a1", "b1", "a2"}


# -- two GPUs (NCCL), the same checks --------------------------------------------------------------

#: a fixed KV cache, so these engines run beside other tests instead of sizing it from free memory
GPU_BLOCKS = dict(num_gpu_blocks_override=64)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gpu_tp2_greedy_equals_tp1(model_dir, engine_adapters, enforce_eager):
    outputs = []
    for tp in (1, 2):
        engine = build(model_dir, tp, dtype=torch.float32, device="cuda", enforce_eager=enforce_eager, **GPU_BLOCKS)
        outputs.append(generate(engine, mixed(engine_adapters, "g")))
        if tp == 2 and not enforce_eager:
            assert engine.runner.graph_steps > 0  # the decode steps replayed graphs on both ranks
        engine.close()
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@two_gpus
def test_gpu_all_reduce_sums_through_the_symmetric_buffer_and_nccl_exactly():
    """Every rank maps the buffer; what fits it is summed through it, eagerly and replayed in a
    graph over new values, the rest through NCCL, each exactly (`tests/all_reduce_driver.py`)."""
    driver = Path(__file__).with_name("all_reduce_driver.py")
    done = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(driver.parent.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.rsplit("RESULT ", 1)[1])
    assert result["mapped"] and result["buffer_bytes"] == 1 << 20
    assert len(result["errors"]) == 6 and all(error == 0 for error in result["errors"].values()), result


@pytest.mark.gpu
@two_gpus
def test_gpu_a_killed_worker_fails_the_step(model_dir):
    engine = build(model_dir, 2, dtype=torch.float32, device="cuda", max_model_len=128, **GPU_BLOCKS)
    pids = engine.workers.pids
    engine.add_request("long", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(WorkerError, match="died"):
        for _ in range(100):
            engine.step()
    engine.close()
    assert_gone(pids)
