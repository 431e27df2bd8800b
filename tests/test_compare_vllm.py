"""benchmarks/compare_vllm.py's peer setup: fetching vLLM's LoRA ops from a wheel, and vLLM's
tuned-config lookup (file named by GPU, entry keyed by max_loras, slices, tokens, hidden, rank).

No network: the fetch is tested on a small synthetic wheel. The tests that run vLLM's own code
need `.thirdparty/vllm_lora` (`python benchmarks/fetch_vllm_lora_ops.py`) and skip without it.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import needs_interpreter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the scripts import each other as top-level modules

import fetch_vllm_lora_ops as fetch  # noqa: E402
import vllm_lora_ops  # noqa: E402

VLLM_OPS = ROOT / ".thirdparty" / "vllm_lora"
needs_vllm_ops = pytest.mark.skipif(
    not (VLLM_OPS / "MANIFEST.json").exists(),
    reason="vLLM's ops are not fetched: run `python benchmarks/fetch_vllm_lora_ops.py` (needs PyPI)")
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def vllm_mods():
    return vllm_lora_ops.load_vllm(str(VLLM_OPS))


@pytest.fixture
def tuned_env():
    """Restore VLLM_TUNED_CONFIG_FOLDER after a test changes it."""
    saved = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    yield
    if saved is None:
        os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    else:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = saved


# ---------------------------------------------------------------------------------------------
# names and options (no vLLM code needed)


@pytest.mark.parametrize("device, op, add_inputs, name", [
    (H100, "shrink", None, "NVIDIA_H100_80GB_HBM3_SHRINK.json"),
    (H100, "expand", True, "NVIDIA_H100_80GB_HBM3_EXPAND_TRUE.json"),
    (H100, "expand", False, "NVIDIA_H100_80GB_HBM3_EXPAND_FALSE.json"),
    ("NVIDIA A100-SXM4-80GB", "shrink", None, "NVIDIA_A100_SXM4_80GB_SHRINK.json"),
])
def test_tuned_config_name_spells_the_gpu_as_vllm_does(device, op, add_inputs, name):
    assert vllm_lora_ops.tuned_config_name(device, op, add_inputs) == name


def test_tuned_config_name_rejects_an_unknown_op():
    with pytest.raises(ValueError, match="'fused'.*'shrink' or 'expand'"):
        vllm_lora_ops.tuned_config_name(H100, "fused")


def test_use_configs_errors_name_the_value_and_the_fix(tmp_path, tuned_env):
    with pytest.raises(ValueError, match="'best'.*tuned, default"):
        vllm_lora_ops.use_configs("best", str(tmp_path))
    with pytest.raises(ValueError, match="missing.*--vllm-config-dir"):
        vllm_lora_ops.use_configs("tuned", str(tmp_path / "missing"))


def test_use_configs_sets_and_unsets_the_folder(tmp_path, tuned_env):
    vllm_lora_ops.use_configs("tuned", str(tmp_path))
    assert os.environ["VLLM_TUNED_CONFIG_FOLDER"] == str(tmp_path)
    vllm_lora_ops.use_configs("default", None)
    assert "VLLM_TUNED_CONFIG_FOLDER" not in os.environ


def test_load_vllm_without_the_folder_says_how_to_fetch(tmp_path):
    with pytest.raises(SystemExit, match="fetch_vllm_lora_ops.py"):
        vllm_lora_ops.load_vllm(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# the fetch, on a synthetic wheel


def fake_wheel(path: Path, ops=fetch.OPS_FILES, configs=("NVIDIA_H100_80GB_HBM3_SHRINK.json",)) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
        z.writestr("vllm-9.9.9.dist-info/licenses/LICENSE", "Apache-2.0\n")
        for name in ops:
            z.writestr(fetch.OPS_DIR + name, f"# {name}\n")
        z.writestr(fetch.OPS_DIR + "__init__.py", "from vllm.lora.ops.triton_ops.fused_moe_lora_op import x\n")
        z.writestr(fetch.OPS_DIR + "fused_moe_lora_op.py", "# not needed\n")
        for name in configs:
            z.writestr(fetch.OPS_DIR + "configs/" + name, "{}")
        z.writestr("vllm/model_executor/layers/fused_moe/configs/E=8.json", "{}")  # not a LoRA config
    return path


def test_extract_takes_the_ops_the_tuned_configs_and_the_shims(tmp_path):
    dest = tmp_path / "vllm_lora"
    manifest = fetch.extract(str(fake_wheel(tmp_path / "vllm.whl")), str(dest))
    assert manifest["vllm_version"] == "9.9.9"
    assert manifest["tuned_configs"] == ["NVIDIA_H100_80GB_HBM3_SHRINK.json"]
    assert sorted(os.listdir(dest / "configs")) == ["NVIDIA_H100_80GB_HBM3_SHRINK.json"]
    ops = dest / fetch.OPS_DIR
    assert sorted(p.name for p in ops.iterdir()) == sorted((*fetch.OPS_FILES, "__init__.py"))
    assert (ops / "lora_shrink_op.py").read_text() == "# lora_shrink_op.py\n"  # unmodified
    assert "import" not in (ops / "__init__.py").read_text()  # vLLM's would pull in fused MoE
    for shim in ("envs.py", "logger.py", "platforms/__init__.py", "triton_utils/__init__.py",
                 "utils/torch_utils.py", "utils/math_utils.py"):
        assert (dest / "vllm" / shim).exists(), shim
    assert json.loads((dest / "MANIFEST.json").read_text())["vllm_version"] == "9.9.9"
    assert (dest / "LICENSE.vllm").exists() and not Path(str(dest) + ".partial").exists()


def test_extract_of_a_wheel_without_the_ops_names_them_and_keeps_the_old_folder(tmp_path):
    dest = tmp_path / "vllm_lora"
    dest.mkdir()
    (dest / "keep").write_text("old")
    wheel = fake_wheel(tmp_path / "vllm.whl", ops=("utils.py",))
    with pytest.raises(SystemExit, match="lacks .*lora_shrink_op.py.*pin a release"):
        fetch.extract(str(wheel), str(dest))
    assert (dest / "keep").read_text() == "old"


# ---------------------------------------------------------------------------------------------
# vLLM's own lookup (needs the fetched ops)


def write_configs(folder: Path, device: str, tables: dict) -> None:
    for (op, add_inputs), table in tables.items():
        (folder / vllm_lora_ops.tuned_config_name(device, op, add_inputs)).write_text(json.dumps(table))


@needs_vllm_ops
def test_vllm_reports_the_tuned_file_of_its_gpu_and_default_for_others(vllm_mods, tmp_path, tuned_env):
    write_configs(tmp_path, H100, {("shrink", None): {"1": {"1": {"1": {"1": {"1": {}}}}}},
                                   ("expand", True): {"1": {"1": {"1": {"1": {"1": {}}}}}}})
    vllm_lora_ops.use_configs("tuned", str(tmp_path))
    vllm_lora_ops.reset_config_caches(vllm_mods)
    assert vllm_lora_ops.config_sources(vllm_mods, H100) == {
        "shrink": "NVIDIA_H100_80GB_HBM3_SHRINK.json", "expand": "NVIDIA_H100_80GB_HBM3_EXPAND_TRUE.json"}
    vllm_lora_ops.reset_config_caches(vllm_mods)
    assert vllm_lora_ops.config_sources(vllm_mods, "NVIDIA H100 PCIe") == {"shrink": "default", "expand": "default"}
    vllm_lora_ops.use_configs("default", None)
    vllm_lora_ops.reset_config_caches(vllm_mods)
    assert vllm_lora_ops.config_sources(vllm_mods, H100) == {"shrink": "default", "expand": "default"}


@needs_vllm_ops
@pytest.mark.parametrize("layer", ["qkv", "gate_up", "down"])
def test_each_case_selects_its_own_tuned_entry(vllm_mods, tmp_path, tuned_env, layer):
    """The keys compare_vllm.py records for a Llama-3-8B case (32 adapter slots, 64 tokens) lead
    vLLM to the entry tuned for exactly that case, not to its neighbours."""
    import compare_vllm

    R, T, S = 16, 64, 32
    x, A, B, y, scales, sizes, slots = compare_vllm.make_case(layer, R, T, S, "cpu", torch.float16)
    keys = compare_vllm.VLLMSide(vllm_mods, x, A, B, sizes, slots, S, specialize=False).config_keys()
    H, N = compare_vllm.LAYERS[layer][0], max(sizes)
    assert keys["shrink"] == dict(op_type="shrink", max_loras=S + 1, batch=T, hidden_size=H, rank=R,
                                  num_slices=len(sizes))
    assert keys["expand"] == dict(op_type="expand", max_loras=S + 1, batch=T, hidden_size=N, rank=R,
                                  num_slices=len(sizes), add_inputs=True)

    def table(k, n, mark):  # the right entry says `mark`; neighbours in every key say something else
        def leaf(tag):
            return {"block_m": 16, "block_n": 16, "block_k": 32, "split_k": 4, "num_warps": 4, "num_ctas": 1,
                    "num_stages": 2, "max_nreg": None, "tag": tag}
        by_m = {str(T): {str(k): {str(n): leaf(mark), str(n * 2): leaf("n")}, str(k * 2): {str(n): leaf("k")}},
                str(T * 4): {str(k): {str(n): leaf("m")}}}
        return {str(S + 1): {str(len(sizes)): by_m, str(len(sizes) + 1): {}}, "1": {str(len(sizes)): {}}}

    write_configs(tmp_path, H100, {("shrink", None): table(H, R, "shrink"), ("expand", True): table(R, N, "expand")})
    vllm_lora_ops.use_configs("tuned", str(tmp_path))
    vllm_lora_ops.reset_config_caches(vllm_mods)
    with vllm_lora_ops.device_named(H100):
        picked = vllm_lora_ops.kernel_configs(vllm_mods, keys)
    assert {op: cfg["tag"] for op, cfg in picked.items()} == {"shrink": "shrink", "expand": "expand"}


@needs_vllm_ops
@needs_interpreter
def test_check_cpu_tuned_lookup_passes(vllm_mods, tuned_env, capsys):
    """--check-cpu's tuned part: vLLM's ops launch with the tuned entry and still agree."""
    import compare_vllm

    assert compare_vllm.check_tuned_cpu(vllm_mods)
    assert "FAIL" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# benchmarks/tune_vllm_lora.py: the search and the files it writes


def test_coordinate_search_finds_the_minimum_and_skips_configs_that_do_not_run():
    import tune_vllm_lora as tune

    target = {"a": 4, "b": 32}
    space = {"a": (1, 2, 4, 8), "b": (16, 32, 64)}

    def measure(cfg):
        if cfg["a"] == 8:
            return None  # e.g. out of shared memory
        return abs(cfg["a"] - target["a"]) + abs(cfg["b"] - target["b"]) + 1.0

    best, us, timed = tune.coordinate_search({"a": 1, "b": 16, "fixed": 0}, space, measure)
    assert best == {"a": 4, "b": 32, "fixed": 0} and us == 1.0
    assert timed[tuple(sorted({"a": 8, "b": 16, "fixed": 0}.items()))] is None


def test_coordinate_search_refuses_a_default_that_does_not_run():
    import tune_vllm_lora as tune

    with pytest.raises(RuntimeError, match="starting config .* does not run"):
        tune.coordinate_search({"a": 1}, {"a": (1, 2)}, lambda cfg: None)


@needs_vllm_ops
def test_tuned_files_merge_and_vllm_reads_each_case_back(vllm_mods, tmp_path, tuned_env):
    import tune_vllm_lora as tune

    def keys(op, T, S, slices):
        k = dict(op_type=op, max_loras=S + 1, batch=T, hidden_size=4096, rank=16, num_slices=slices)
        return dict(k, add_inputs=True) if op == "expand" else k

    cfg = {"block_m": 16, "block_n": 16, "block_k": 64, "split_k": 8, "num_warps": 4, "num_ctas": 1,
           "num_stages": 3, "max_nreg": None}
    cases = [(1, 1, 3), (4096, 32, 3), (64, 32, 1)]
    for i, (T, S, n) in enumerate(cases):  # one save per case: later runs merge into the files
        tables = {"shrink": {}, "expand": {}}
        for op in tables:
            tune.insert_entry(tables[op], keys(op, T, S, n), dict(cfg, block_m=16 * (i + 1)))
        tune.save_tables(tables, str(tmp_path), H100)
    assert sorted(os.listdir(tmp_path)) == ["NVIDIA_H100_80GB_HBM3_EXPAND_TRUE.json",
                                            "NVIDIA_H100_80GB_HBM3_SHRINK.json"]
    vllm_lora_ops.use_configs("tuned", str(tmp_path))
    vllm_lora_ops.reset_config_caches(vllm_mods)
    with vllm_lora_ops.device_named(H100):
        for i, (T, S, n) in enumerate(cases):
            got = vllm_lora_ops.kernel_configs(vllm_mods, {op: keys(op, T, S, n) for op in ("shrink", "expand")})
            assert {op: c["block_m"] for op, c in got.items()} == {"shrink": 16 * (i + 1), "expand": 16 * (i + 1)}
