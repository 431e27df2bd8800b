"""Shared fixtures: tiny random-config models and PEFT adapters saved to disk.

Adapters are made with PEFT itself (``init_lora_weights=False`` so B is not zero), which makes
PEFT the oracle for everything loramux computes from them.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_llama(seed: int = 0):
    """A 2-layer Llama with random weights (deterministic for a seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()


def save_peft_adapter(model, directory: Path, *, seed: int = 0, **lora_kwargs) -> Path:
    """Wrap ``model`` with a fresh PEFT LoRA built from ``lora_kwargs`` and save it."""
    from peft import LoraConfig, get_peft_model

    lora_kwargs.setdefault("r", 8)
    lora_kwargs.setdefault("lora_alpha", 16)
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(directory)
    peft_model.unload()  # give the caller its model back unwrapped
    return directory


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory):
    """Factory: ``make_adapter(name=None, *, model=None, seed=0, **LoraConfig kwargs) -> Path``.

    Defaults: a fresh tiny Llama, r=8, alpha=16, targets q_proj and v_proj.
    """
    counter = itertools.count()

    def make(name: str | None = None, *, model=None, seed: int = 0, **lora_kwargs) -> Path:
        directory = tmp_path_factory.mktemp("adapters") / (name or f"adapter{next(counter)}")
        return save_peft_adapter(model or tiny_llama(), directory, seed=seed, **lora_kwargs)

    return make


# --- kernels -------------------------------------------------------------------------------------
# Without CUDA the Triton kernels run under the interpreter. Triton reads TRITON_INTERPRET when a
# @triton.jit function is defined, and loramux imports its kernel modules lazily, so setting it here
# (before any test module is imported) holds for the whole pytest process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA = torch.cuda.is_available()
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="CPU Triton tests need TRITON_INTERPRET=1 before triton loads (conftest sets it without CUDA)"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
two_gpus = pytest.mark.gpus(2)  # skipped with fewer (`pytest_runtest_setup`)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere gives inf (never passes)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


# --- the environment -----------------------------------------------------------------------------
# loramux reads its environment variables once (loramux.envs); each test starts from the
# environment as it is then, and a test that changes a variable reads it again with `setenv`.


@pytest.fixture(autouse=True)
def _fresh_envs():
    from loramux import envs

    envs.refresh()
    yield
    envs.refresh()  # after monkeypatch put the environment back (this fixture was set up first)


def setenv(monkeypatch, name: str, value: str | None):
    """Set (None: unset) environment variable ``name`` for this test and have loramux read it again."""
    from loramux import envs

    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    return envs.refresh()


# --- LoRA layers and model patching --------------------------------------------------------------
TINY_ARCHS = ("llama", "qwen2", "mistral", "gemma", "phi3", "gpt2")


def tiny_model(arch: str, seed: int = 0):
    """A 2-layer random-weight causal LM of ``arch`` (one of TINY_ARCHS), in eval mode."""
    import transformers

    common = {**TINY_LLAMA, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "mistral": lambda: transformers.MistralConfig(**common),
        "gemma": lambda: transformers.GemmaConfig(**common, head_dim=8),  # tied, scaled embedding
        "phi3": lambda: transformers.Phi3Config(**common),  # fused qkv_proj / gate_up_proj
        "gpt2": lambda: transformers.GPT2Config(  # Conv1D, tied lm_head
            vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
            eos_token_id=2,
        ),
    }
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(configs[arch]()).eval()


# --------------------------------------------------------------------------------------------------
# Generation engine
# --------------------------------------------------------------------------------------------------


def step_to_end(engine, *, max_steps: int = 2000, each_step=None) -> dict[str, list[int]]:
    """Step ``engine`` until no request is left (at most ``max_steps``), calling ``each_step()``
    before every step; the generated tokens per request id. A request that ends with an error
    fails the test."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        if each_step is not None:
            each_step()
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                finished[out.request_id] = out.outputs[0].token_ids
    return finished


def peft_greedy(adapter_path, prompt_ids: list[int], max_new_tokens: int, *, model=None) -> list[int]:
    """The oracle: transformers (+ PEFT for an adapter) greedy ``generate`` on one prompt."""
    from peft import PeftModel

    base = model if model is not None else tiny_llama()
    runner = base if adapter_path is None else PeftModel.from_pretrained(base, adapter_path)
    with torch.no_grad():
        out = runner.generate(
            input_ids=torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    if adapter_path is not None:
        runner.unload()
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture
def gemm_onto_delta_calls(monkeypatch) -> list[int]:
    """The token count of every forward that ran a projection's base GEMM onto its stored delta
    (the kernel backend's `Route.DELTA_THEN_GEMM`), for the test's duration."""
    from loramux.engine.layers import Route, backend

    calls: list[int] = []
    run = backend.ROUTE_BODIES[Route.DELTA_THEN_GEMM]
    monkeypatch.setitem(backend.ROUTE_BODIES, Route.DELTA_THEN_GEMM,
                        lambda layer, x, meta: calls.append(meta.num_tokens) or run(layer, x, meta))
    return calls


def resident_requests(llm, names: list[str | None], paths: dict, ids: dict[str, int]) -> list:
    """One request per name (None: the base model), their adapters read into host memory first, so
    every request is schedulable in the engine's first step (loads ending apart split a batch)."""
    from loramux import LoRARequest

    requests = [None if n is None else LoRARequest(n, ids[n], str(paths[n])) for n in names]
    for request in {r for r in requests if r is not None}:
        llm.llm_engine.add_lora(request)
    return requests


def assert_greedy_matches_peft(adapter_path, prompt_ids: list[int], token_ids: list[int], label: str = "") -> None:
    """``token_ids`` (a request that ignores end-of-sequence) are `peft_greedy`'s tokens, up to and
    including its end-of-sequence token where transformers stopped there."""
    reference = peft_greedy(adapter_path, prompt_ids, len(token_ids))
    assert len(reference) == len(token_ids) or reference[-1] == 2, reference
    assert list(token_ids[: len(reference)]) == reference, label


def char_tokenizer():
    """A character-level tokenizer whose 128 tokens match the tiny Llama's vocabulary, so every
    generated id decodes to a character (bos 1, eos 2, a chat template)."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = list(dict.fromkeys(string.ascii_letters + string.digits + string.punctuation + " \n"))
    chars += [chr(c) for c in range(0xC0, 0xC0 + 128 - len(specials) - len(chars))]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    assert len(vocab) == 128
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    return tokenizer


@pytest.fixture(scope="session")
def engine_adapters(make_adapter):
    """Three PEFT adapters for `tiny_llama()`: attention only, every projection (r=4), MLP down only."""
    all_projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "attn": make_adapter("attn", seed=11),
        "all": make_adapter("all", seed=12, r=4, lora_alpha=8, target_modules=all_projections),
        "mlp": make_adapter("mlp", seed=13, target_modules=["down_proj"]),
    }


# --------------------------------------------------------------------------------------------------
# Plugins and resolvers
# --------------------------------------------------------------------------------------------------

PLUGIN_ENV_VARS = (
    "LORAMUX_PLUGINS",
    "LORAMUX_TRACE_HOOKS",
    "LORAMUX_LORA_RESOLVERS",
    "LORAMUX_LORA_RESOLVER_DIR",
    "LORAMUX_LORA_RESOLVER_HF_REPO_LIST",
    "LORAMUX_S3_URI",
    "LORAMUX_S3_MAX_BYTES",
    "LORAMUX_ZIP_DIR",
)


@pytest.fixture
def clean_plugin_env(monkeypatch, tmp_path):
    """No plugin or resolver settings, a private cache dir, and a freshly loaded plugin manager.

    Each variable is recorded before it is removed, so whatever a test (or the CLI it runs)
    sets is undone afterwards. Yields the cache dir.
    """
    from loramux.plugins.manager import reset_plugin_manager

    for var in PLUGIN_ENV_VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    cache = tmp_path / "cache"
    setenv(monkeypatch, "LORAMUX_CACHE_DIR", str(cache))
    reset_plugin_manager()
    yield cache
    reset_plugin_manager()


@pytest.fixture
def registered():
    """Factory: ``registered(plugin, name) -> name`` registers a plugin in-process for one test;
    it is unregistered in ``finally``."""
    from loramux.plugins.manager import get_plugin_manager, register_plugin

    names = []

    def register(plugin, name: str) -> str:
        names.append(register_plugin(plugin, name=name))
        return name

    try:
        yield register
    finally:
        for name in names:
            if get_plugin_manager().get_plugin(name) is not None:
                get_plugin_manager().unregister(name=name)


def pytest_collection_modifyitems(config, items):
    """Tests that need several GPUs first: each holds them for a while, so under pytest-xdist they
    start beside the others instead of trailing after them."""
    items.sort(key=lambda item: item.get_closest_marker("gpus") is None)  # stable: otherwise as collected


def pytest_runtest_setup(item):
    needs = item.get_closest_marker("gpus")  # before any fixture builds what the test would use
    if needs is not None and torch.cuda.device_count() < needs.args[0]:
        pytest.skip(f"needs {needs.args[0]} CUDA GPUs")


@pytest.fixture(autouse=True)
def _gpu_share(request, tmp_path_factory):
    """GPU tests run side by side under pytest-xdist (``pytest -m gpu -n 6``: their Triton compiles
    take the host's cores); a `whole_gpu` test holds the GPU alone. Lock files shared by the
    workers: other gpu tests take the GPU lock shared, a `whole_gpu` test exclusively. A test
    passes a turnstile before it waits, which a waiting `whole_gpu` test holds: the shared tests
    running finish, no new one starts, and it gets its turn (flock alone would let a stream of
    shared holders starve it)."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import fcntl

    locks = tmp_path_factory.getbasetemp().parent  # one place for all workers
    exclusive = request.node.get_closest_marker("whole_gpu") is not None
    with open(locks / "loramux-gpu.turnstile", "a") as turnstile, open(locks / "loramux-gpu.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not exclusive:  # through it at once, unless a whole_gpu test waits there
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
