"""The kernels benchmark's peer (benchmarks/vllm_ops.py): fetching vLLM's LoRA ops from a wheel,
vLLM's tuned-config lookup (file named by GPU, entry keyed by max_loras, slices, tokens, hidden,
rank), its ops agreeing with our reference on the CPU, and scripts/tune_vllm_lora.py's search.

No network: the fetch is tested on a small synthetic wheel. The tests that run vLLM's own code
need `.thirdparty/vllm_lora` (`python benchmarks/vllm_ops.py`) and skip without it.
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # the tools import each other as top-level modules

from benchmarks import kernels  # noqa: E402
from benchmarks import vllm_ops  # noqa: E402

VLLM_OPS = ROOT / ".thirdparty" / "vllm_lora"
needs_vllm_ops = pytest.mark.skipif(
    not (VLLM_OPS / "MANIFEST.json").exists(),
    reason="vLLM's ops are not fetched: run `python benchmarks/vllm_ops.py` (needs PyPI)")
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def vllm_mods():
    return vllm_ops.load_vllm(str(VLLM_OPS))


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
    assert vllm_ops.tuned_config_name(device, op, add_inputs) == name


def test_tuned_config_name_rejects_an_unknown_op():
    with pytest.raises(ValueError, match="'fused'.*'shrink' or 'expand'"):
        vllm_ops.tuned_config_name(H100, "fused")


def test_use_configs_errors_name_the_value_and_the_fix(tmp_path, tuned_env):
    with pytest.raises(ValueError, match="'best'.*tuned, default"):
        vllm_ops.use_configs("best", str(tmp_path))
    with pytest.raises(ValueError, match="missing.*--vllm-config-dir"):
        vllm_ops.use_configs("tuned", str(tmp_path / "missing"))


def test_use_configs_sets_and_unsets_the_folder(tmp_path, tuned_env):
    vllm_ops.use_configs("tuned", str(tmp_path))
    assert os.environ["VLLM_TUNED_CONFIG_FOLDER"] == str(tmp_path)
    vllm_ops.use_configs("default", None)
    assert "VLLM_TUNED_CONFIG_FOLDER" not in os.environ


def test_load_vllm_without_the_folder_says_how_to_fetch(tmp_path):
    with pytest.raises(SystemExit, match="benchmarks/vllm_ops.py"):
        vllm_ops.load_vllm(str(tmp_path))


def test_the_shipped_tuned_configs_are_named_and_nested_as_vllm_reads_them():
    """benchmarks/vllm_configs: vLLM's file names for the H100, each a
    [max_loras][num_slices][m][k][n] table whose leaves are launch configs."""
    folder = Path(vllm_ops.TUNED_CONFIGS)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        vllm_ops.tuned_config_name(H100, op, add) for op, add in (("shrink", None), ("expand", True)))
    for path in folder.iterdir():
        def leaves(node, depth=0):
            if "block_m" in node:
                assert depth == 5, path.name
                yield node
            else:
                for child in node.values():
                    yield from leaves(child, depth + 1)
        found = list(leaves(json.loads(path.read_text())))
        assert found and all({"block_m", "block_n", "num_warps", "num_stages"} <= set(leaf) for leaf in found)


# ---------------------------------------------------------------------------------------------
# the fetch, on a synthetic wheel


def fake_wheel(path: Path, ops=vllm_ops.OPS_FILES, configs=("NVIDIA_H100_80GB_HBM3_SHRINK.json",)) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
        z.writestr("vllm-9.9.9.dist-info/licenses/LICENSE", "Apache-2.0\n")
        for name in ops:
            z.writestr(vllm_ops.OPS_DIR + name, f"# {name}\n")
        z.writestr(vllm_ops.OPS_DIR + "__init__.py", "from vllm.lora.ops.triton_ops.fused_moe_lora_op import x\n")
        z.writestr(vllm_ops.OPS_DIR + "fused_moe_lora_op.py", "# not needed\n")
        for name in configs:
            z.writestr(vllm_ops.OPS_DIR + "configs/" + name, "{}")
        z.writestr("vllm/model_executor/layers/fused_moe/configs/E=8.json", "{}")  # not a LoRA config
    return path


def test_extract_takes_the_ops_and_the_shims(tmp_path):
    dest = tmp_path / "vllm_lora"
    manifest = vllm_ops.extract(str(fake_wheel(tmp_path / "vllm.whl")), str(dest))
    assert manifest["vllm_version"] == "9.9.9" and set(manifest["files_sha256"]) == {
        vllm_ops.OPS_DIR + name for name in vllm_ops.OPS_FILES}
    ops = dest / vllm_ops.OPS_DIR
    assert sorted(p.name for p in ops.iterdir()) == sorted((*vllm_ops.OPS_FILES, "__init__.py"))
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
        vllm_ops.extract(str(wheel), str(dest))
    assert (dest / "keep").read_text() == "old"


# ---------------------------------------------------------------------------------------------
# vLLM's own lookup (needs the fetched ops)


def write_configs(folder: Path, device: str, tables: dict) -> None:
    for (op, add_inputs), table in tables.items():
        (folder / vllm_ops.tuned_config_name(device, op, add_inputs)).write_text(json.dumps(table))


@needs_vllm_ops
def test_vllm_reports_the_tuned_file_of_its_gpu_and_default_for_others(vllm_mods, tmp_path, tuned_env):
    write_configs(tmp_path, H100, {("shrink", None): {"1": {"1": {"1": {"1": {"1": {}}}}}},
                                   ("expand", True): {"1": {"1": {"1": {"1": {"1": {}}}}}}})
    vllm_ops.use_configs("tuned", str(tmp_path))
    vllm_ops.reset_config_caches(vllm_mods)
    assert vllm_ops.config_sources(vllm_mods, H100) == {
        "shrink": "NVIDIA_H100_80GB_HBM3_SHRINK.json", "expand": "NVIDIA_H100_80GB_HBM3_EXPAND_TRUE.json"}
    vllm_ops.reset_config_caches(vllm_mods)
    assert vllm_ops.config_sources(vllm_mods, "NVIDIA H100 PCIe") == {"shrink": "default", "expand": "default"}
    vllm_ops.use_configs("default", None)
    vllm_ops.reset_config_caches(vllm_mods)
    assert vllm_ops.config_sources(vllm_mods, H100) == {"shrink": "default", "expand": "default"}


@needs_vllm_ops
@pytest.mark.parametrize("layer", ["qkv", "gate_up", "down"])
def test_each_case_selects_its_own_tuned_entry(vllm_mods, tmp_path, tuned_env, layer):
    """The keys the benchmark records for a Llama-3-8B case (32 adapter slots, 64 tokens) lead
    vLLM to the entry tuned for exactly that case, not to its neighbours."""
    R, T, S = 16, 64, 32
    x, A, B, y, scales, sizes, slots = kernels.make_case(layer, R, T, S, "cpu", torch.float16)
    keys = vllm_ops.VLLMSide(vllm_mods, x, A, B, sizes, slots, S, specialize=False).config_keys()
    H, N = kernels.LAYERS[layer][0], max(sizes)
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
    vllm_ops.use_configs("tuned", str(tmp_path))
    vllm_ops.reset_config_caches(vllm_mods)
    with vllm_ops.device_named(H100):
        picked = vllm_ops.kernel_configs(vllm_mods, keys)
    assert {op: cfg["tag"] for op, cfg in picked.items()} == {"shrink": "shrink", "expand": "expand"}


@needs_vllm_ops
@needs_interpreter
@pytest.mark.parametrize("specialize", [False, True])
@pytest.mark.parametrize("H, sizes, R, S, T", [(64, (64, 16, 16), 16, 3, 13), (32, (48, 48), 16, 2, 130)])
def test_vllms_ops_agree_with_our_reference_on_mixed_batches(vllm_mods, tuned_env, H, sizes, R, S, T, specialize):
    """The layouts the benchmark hands vLLM's ops: its shrink -> expand on a tiny float16 batch
    (some tokens without an adapter) equals our float32 reference."""
    from loramux.kernels import build_lora_meta, reference

    vllm_ops.use_configs("default", None)  # vLLM's tuned lookup asks CUDA for the device name
    vllm_ops.reset_config_caches(vllm_mods)
    x, A, B, y, scales, sizes, slots = kernels.make_case("qkv", R, T, S, "cpu", torch.float16, dims=(H, sizes))
    slots[::5] = -1
    meta = build_lora_meta(slots, S)
    buf_ref = reference.lora_shrink_ref(x.float(), A.float(), scales, meta)
    y_ref = y.float()
    reference.lora_expand_ref(y_ref, buf_ref, B.float(), sizes, meta)
    side = vllm_ops.VLLMSide(vllm_mods, x, A, B, sizes, slots, S, specialize=specialize)
    buf = side.shrink(x).clone()
    y_v = y.clone()
    side.expand(y_v, buf)
    assert kernels.rel_err(buf.permute(1, 0, 2).reshape(T, len(sizes) * R), buf_ref) < 2e-3
    assert kernels.rel_err(y_v.float() - y.float(), y_ref - y.float()) < 2e-2


# ---------------------------------------------------------------------------------------------
# scripts/tune_vllm_lora.py: the search and the files it writes


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
    vllm_ops.use_configs("tuned", str(tmp_path))
    vllm_ops.reset_config_caches(vllm_mods)
    with vllm_ops.device_named(H100):
        for i, (T, S, n) in enumerate(cases):
            got = vllm_ops.kernel_configs(vllm_mods, {op: keys(op, T, S, n) for op in ("shrink", "expand")})
            assert {op: c["block_m"] for op, c in got.items()} == {"shrink": 16 * (i + 1), "expand": 16 * (i + 1)}
