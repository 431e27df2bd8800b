"""Tuned shrink launch shapes (`loramux.kernels.tuned`): the file a device reads, which entry a
launch takes, which launches read it at all, and scripts/tune_shrink.py that writes it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import needs_cuda, needs_interpreter, rel_err, setenv
from loramux.kernels import build_lora_meta, reference, tuned
from loramux.kernels import shrink as shrink_mod
from loramux.kernels.shrink import ShrinkConfig, lora_shrink_triton, shrink_config

ROOT = Path(__file__).resolve().parents[1]
H100 = "NVIDIA H100 80GB HBM3"
CUDA = torch.device("cuda")  # never touched: the lookup asks torch.cuda for the name only
CFG = dict(block_m=32, block_n=16, block_k=64, split_k=4, num_warps=4, num_stages=3)


def entry(tokens, *, many=False, rank=16, n_slices=3, hidden=4096, dtype="bfloat16", **config):
    return dict(dtype=dtype, n_slices=n_slices, rank=rank, hidden=hidden, tokens=tokens, many_adapters=many,
                config=dict(CFG, **config))


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    """An empty tuned-config folder read as an H100's; write(entries) fills its shrink file."""
    setenv(monkeypatch, tuned.CONFIG_DIR_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    tuned._device_index.cache_clear()

    def write(entries, text=None):
        path = tmp_path / tuned.config_file_name(H100)
        path.write_text(text if text is not None else json.dumps({"device": H100, "entries": entries}))
        tuned._device_index.cache_clear()
        return path

    yield write
    tuned._device_index.cache_clear()


def lookup(tokens, many=False, **key):
    args = dict(dtype=torch.bfloat16, n_slices=3, rank=16, hidden=4096)
    args.update(key)
    return tuned.tuned_shrink_config(CUDA, args["dtype"], args["n_slices"], args["rank"], args["hidden"], tokens, many)


@pytest.mark.parametrize("device, name", [
    (H100, "NVIDIA_H100_80GB_HBM3_shrink.json"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA_A100_SXM4_80GB_shrink.json"),
])
def test_file_name_spells_the_gpu_with_underscores(device, name):
    assert tuned.config_file_name(device) == name


def test_the_package_ships_an_h100_file_the_lookup_reads(monkeypatch):
    setenv(monkeypatch, tuned.CONFIG_DIR_ENV_VAR, None)
    path = tuned.DEFAULT_DIR / tuned.config_file_name(H100)
    body = json.loads(path.read_text())
    assert body["device"] == H100 and body["entries"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    tuned._device_index.cache_clear()
    try:
        e = body["entries"][0]
        got = tuned.tuned_shrink_config(CUDA, getattr(torch, e["dtype"]), e["n_slices"], e["rank"], e["hidden"],
                                        e["tokens"], e["many_adapters"])
        assert got == e["config"]
    finally:
        tuned._device_index.cache_clear()


def test_a_launch_takes_the_entry_nearest_its_token_count_within_a_factor_of_two(tuned_dir):
    tuned_dir([entry(16, block_m=16), entry(64, block_m=64), entry(1024, split_k=8)])
    assert lookup(16)["block_m"] == 16
    assert lookup(24)["block_m"] == 16  # log2 distance 0.58 against 1.42
    assert lookup(48)["block_m"] == 64
    assert lookup(32)["block_m"] == 16  # a tie: the smaller token count
    assert lookup(128)["block_m"] == 64
    assert lookup(129) is None  # over a factor of 2 from 64, and 256+ is the prefill side
    assert lookup(4) is None
    assert lookup(600)["split_k"] == 8
    assert lookup(2048)["split_k"] == 8
    assert lookup(2049) is None


def test_decode_and_prefill_entries_never_stand_in_for_each_other(tuned_dir):
    tuned_dir([entry(256, block_m=16), entry(512, block_m=64)])
    assert lookup(256)["block_m"] == 16
    assert lookup(257)["block_m"] == 64  # prefill-sized: only the prefill entry, though 256 is nearer
    tuned_dir([entry(512, block_m=64)])
    assert lookup(256) is None


def test_the_key_is_dtype_slices_rank_hidden_and_one_or_many_adapters(tuned_dir):
    tuned_dir([entry(64), entry(64, many=True, block_n=32)])
    assert lookup(64) == CFG
    assert lookup(64, many=True)["block_n"] == 32
    assert lookup(64, dtype=torch.float16) is None
    assert lookup(64, n_slices=1) is None
    assert lookup(64, rank=64) is None
    assert lookup(64, hidden=14336) is None


def test_no_file_or_no_gpu_means_the_heuristics(tuned_dir):
    assert lookup(64) is None  # the folder has no file for this device
    tuned_dir([entry(64)])
    assert tuned.tuned_shrink_config(torch.device("cpu"), torch.bfloat16, 3, 16, 4096, 64, False) is None


@pytest.mark.parametrize("text, why", [
    ("{not json", "JSONDecodeError"),
    (json.dumps({"device": H100}), "KeyError"),
    (json.dumps({"entries": [dict(entry(64), config={"block_m": 16})]}), "KeyError"),
    (json.dumps({"entries": [entry(64, split_k=0)]}), "below 1"),
])
def test_a_malformed_file_names_itself_and_the_fix(tuned_dir, text, why):
    path = tuned_dir(None, text=text)
    with pytest.raises(ValueError, match=why) as err:
        lookup(64)
    assert str(path) in str(err.value) and "tune_shrink.py" in str(err.value)
    tuned_dir([entry(64)])  # a good file afterwards is read: nothing was cached from the bad one
    assert lookup(64) == CFG


@pytest.fixture
def spy(monkeypatch):
    """shrink_config's tuned lookup, recorded; it answers CFG."""
    calls = []

    def fake(device, dtype, n_slices, rank, hidden, num_tokens, many_adapters):
        calls.append((n_slices, rank, hidden, num_tokens, many_adapters))
        return dict(CFG)

    monkeypatch.setattr(shrink_mod, "tuned_shrink_config", fake)
    return calls


def test_an_eager_launch_on_every_sm_takes_the_tuned_shape(spy):
    cpu = torch.device("cpu")
    one = build_lora_meta(torch.zeros(64, dtype=torch.int32), 4)
    assert shrink_config(one, 48, 4096, torch.bfloat16, cpu, rank=16) == ShrinkConfig(**CFG)
    mixed = build_lora_meta(torch.arange(64, dtype=torch.int32) % 3, 4)
    shrink_config(mixed, 48, 4096, torch.bfloat16, cpu, rank=16)
    prefill = build_lora_meta(torch.arange(600, dtype=torch.int32) % 3, 4)
    shrink_config(prefill, 64, 4096, torch.bfloat16, cpu)
    # a prefill-sized launch asks for the one-adapter entry whatever its mix (its shape is T's alone)
    assert spy == [(3, 16, 4096, 64, False), (3, 16, 4096, 64, True), (1, 64, 4096, 600, False)]


def test_graph_launches_and_launches_beside_a_gemm_keep_the_heuristics(spy):
    cpu = torch.device("cpu")
    static = build_lora_meta(torch.zeros(64, dtype=torch.int32), 4, static=True)
    assert shrink_config(static, 48, 4096, torch.bfloat16, cpu, rank=16) != ShrinkConfig(**CFG)
    exact = build_lora_meta(torch.zeros(64, dtype=torch.int32), 4)
    assert shrink_config(exact, 48, 4096, torch.bfloat16, cpu, sms=44, rank=16) != ShrinkConfig(**CFG)
    assert spy == []


@needs_interpreter
def test_a_tuned_shape_runs_and_agrees_with_the_reference(monkeypatch):
    """The launch a tuned entry gives (tiles, blocks and splits unlike the heuristic's) computes
    the same product; a wrong split or tile mapping would show here."""
    config = dict(block_m=16, block_n=16, block_k=32, split_k=2, num_warps=4, num_stages=2)
    monkeypatch.setattr(shrink_mod, "tuned_shrink_config", lambda *a: dict(config))
    torch.manual_seed(0)
    T, H, S, R = 40, 64, 3, 16
    x = torch.randn(T, H)
    a = torch.randn(S, 2 * R, H) / H ** 0.5
    scales = torch.full((S, 2), 0.5)
    slots = torch.randint(-1, S, (T,), dtype=torch.int32)
    meta = build_lora_meta(slots, S)
    launch = shrink_mod.shrink_launch(meta, 2 * R, H, x.dtype, x.device, rank=R)
    assert launch.config == ShrinkConfig(**config) and launch.split_k == 2
    out = lora_shrink_triton(x, a, scales, meta)
    ref = reference.lora_shrink_ref(x, a, scales, meta)
    rows = slots >= 0
    assert rel_err(out[rows], ref[rows]) < 1e-5


# --- scripts/tune_shrink.py --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tune_shrink():
    sys.path.insert(0, str(ROOT / "scripts"))
    import tune_shrink

    return tune_shrink


def test_merge_replaces_entries_of_the_same_key_and_keeps_the_rest(tune_shrink, tmp_path, tuned_dir):
    path = str(tmp_path / tuned.config_file_name(H100))
    assert tune_shrink.merge_entries(path, H100, [entry(16), entry(64)]) == 2
    assert tune_shrink.merge_entries(path, H100, [entry(64, block_m=64), entry(64, many=True)]) == 3
    body = json.loads(Path(path).read_text())
    assert body["device"] == H100
    assert [(e["tokens"], e["many_adapters"], e["config"]["block_m"]) for e in body["entries"]] == [
        (16, False, 32), (64, False, 64), (64, True, 32)]
    tuned._device_index.cache_clear()
    assert lookup(64)["block_m"] == 64  # the lookup reads what the tuner wrote


@needs_interpreter
def test_tune_case_searches_from_the_heuristic_and_returns_a_readable_entry(tune_shrink):
    timings = iter(range(1000, 0, -1))  # each new candidate times "faster": the search keeps every change
    log = []
    dims = (64, (32, 16, 16))
    e, best_us, start_us, n = tune_shrink.tune_case(
        "qkv", 16, 5, 3, torch.device("cpu"), lambda fn: (fn(), next(timings))[1], dtype=torch.float32,
        dims=dims, log=log, space=dict(split_k=(1, 2), block_k=(32,)), rounds=1)
    assert best_us < start_us == 1000 and n == len(log)  # the start is the first timing
    assert all("skipped" not in r for r in log)  # every candidate agreed with the heuristic's output
    *_, slots = tune_shrink.make_case("qkv", 16, 5, 3, "cpu", torch.float32, dims=dims)
    many = build_lora_meta(slots, 3).num_active > 1
    assert (e["dtype"], e["n_slices"], e["rank"], e["hidden"], e["tokens"], e["many_adapters"]) == (
        "float32", 3, 16, 64, 5, many)
    assert set(e["config"]) == set(tuned.CONFIG_FIELDS) and e["config"]["block_k"] == 32


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_shipped_tuned_shapes_of_this_device_launch_and_agree_with_the_reference():
    """Each tuned shape of this GPU's file (a sample of 12) is the one an eager launch takes at
    its case, and computes what the float32 reference does, in bfloat16."""
    tuned._device_index.cache_clear()
    device = torch.device("cuda")
    path = tuned.config_dir() / tuned.config_file_name(torch.cuda.get_device_name(device))
    if not path.is_file():
        pytest.skip(f"no tuned shrink configs for this GPU ({path.name})")
    entries = [e for e in json.loads(path.read_text())["entries"] if e["tokens"] <= 1024]
    for e in entries[:: max(1, len(entries) // 12)]:
        g = torch.Generator().manual_seed(e["tokens"])
        T, H, n, R = e["tokens"], e["hidden"], e["n_slices"], e["rank"]
        slots = (torch.arange(T, dtype=torch.int32) % (3 if e["many_adapters"] else 1)).to(device)
        meta = build_lora_meta(slots, 4)
        assert (meta.num_active > 1) == e["many_adapters"]
        x = torch.randn(T, H, generator=g).to(device, getattr(torch, e["dtype"]))
        a = (torch.randn(4, n * R, H, generator=g) / H ** 0.5).to(device, x.dtype)
        scales = torch.full((4, n), 0.5, device=device)
        launch = shrink_mod.shrink_launch(meta, n * R, H, x.dtype, device, rank=R)
        assert launch.config == ShrinkConfig(**e["config"]), e
        out = lora_shrink_triton(x, a, scales, meta)
        ref = reference.lora_shrink_ref(x.float(), a.float(), scales, meta)
        assert rel_err(out, ref) < 1e-4, e
