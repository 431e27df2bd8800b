"""vLLM's multi-LoRA Triton ops as the kernels benchmark's peer: fetched from a pinned vLLM wheel,
loaded without installing vLLM, pointed at tuned launch configs, and called in vLLM's own layout.

    python benchmarks/vllm_ops.py                    # once, needs PyPI: the pinned wheel's ops
    python benchmarks/vllm_ops.py --wheel W.whl      # or from a wheel already on disk

The fetch writes vLLM's own, unmodified ``vllm/lora/ops/triton_ops/{lora_shrink_op, lora_expand_op,
kernel_utils, lora_kernel_metadata, utils}.py`` (with the wheel's LICENSE), our shims for the
``vllm.*`` modules they import (``benchmarks/vllm_shims/``) and MANIFEST.json (version, sha256 of
each file) into ``.thirdparty/vllm_lora/``: about 80 kB, git-ignored, small enough to carry to a GPU
machine without network. The pinned release's five files import nothing beyond torch, triton and
the shimmed names; the shims (ours, Apache-2.0) stand in for ``vllm.envs``, ``vllm.logger``,
``vllm.platforms``, ``vllm.triton_utils`` and ``vllm.utils`` with vLLM's defaults.

Launch configs: vLLM's ``get_lora_op_configs(op, max_loras, batch, hidden_size, rank, num_slices,
add_inputs)`` returns a built-in default unless ``VLLM_TUNED_CONFIG_FOLDER`` names a folder holding
``<GPU>_SHRINK.json`` / ``<GPU>_EXPAND_<TRUE|FALSE>.json`` (<GPU>: the device name with " " and "-"
as "_"), nested ``[max_loras][num_slices][m][k][n] -> config``, each level taking the exact key or
else the nearest; its ops pass max_loras + 1, m = tokens, (k, n) = (hidden, rank) for shrink and
(rank, widest slice) for expand. vLLM ships no tuned LoRA configs, so ``scripts/tune_vllm_lora.py``
searches them per case on the GPU and ``benchmarks/vllm_configs/`` keeps them: vLLM runs with the
best configs found for it. We set the variable and let vLLM's own code do the lookup;
`config_sources` reads back what it found.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from typing import Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_VERSION = "0.33.0"
DEFAULT_OPS = os.path.join(os.path.dirname(HERE), ".thirdparty", "vllm_lora")
TUNED_CONFIGS = os.path.join(HERE, "vllm_configs")
OPS_PACKAGE = "vllm.lora.ops.triton_ops"
OPS_DIR = "vllm/lora/ops/triton_ops/"
OPS_FILES = ("lora_shrink_op.py", "lora_expand_op.py", "kernel_utils.py", "lora_kernel_metadata.py", "utils.py")
OPS_MODULES = ("lora_shrink_op", "lora_expand_op", "lora_kernel_metadata", "utils")
# empty package markers: vLLM's own __init__.py files import the whole package (fused MoE, models)
PACKAGE_INITS = ("vllm/lora/__init__.py", "vllm/lora/ops/__init__.py", OPS_DIR + "__init__.py")
CONFIG_MODES = ("tuned", "default")
# expand is called as vLLM's Punica wrapper does for linear layers (y += ...): the _EXPAND_TRUE file
EXPAND_ADD_INPUTS = True
SCALE = 2.0  # vLLM's shrink takes one float scaling for all adapters; ours gets 2.0 per slot too


# -- loading -----------------------------------------------------------------------------------


def load_vllm(path: str = DEFAULT_OPS) -> dict:
    """Import vLLM's ops from ``path`` (a fetched folder) as the package ``vllm``.

    :returns: the modules {"lora_shrink_op", "lora_expand_op", "lora_kernel_metadata", "utils"}.
    """
    ops_dir = os.path.join(path, *OPS_PACKAGE.split("."))
    missing = [m + ".py" for m in OPS_MODULES if not os.path.exists(os.path.join(ops_dir, m + ".py"))]
    if missing or not os.path.exists(os.path.join(path, "vllm", "envs.py")):
        sys.exit(f"vLLM LoRA ops not found in {path!r} (missing: {', '.join(missing) or 'the vllm.* shims'}).\n"
                 "Fetch them once with `python benchmarks/vllm_ops.py` (needs PyPI), carry the folder to the GPU "
                 "machine, or pass --vllm-ops DIR.")
    loaded = sys.modules.get("vllm")
    if loaded is not None and not os.path.abspath(getattr(loaded, "__file__", "") or "").startswith(os.path.abspath(path)):
        sys.exit(f"a different `vllm` is already imported ({loaded.__file__}); run in a process that has not imported vLLM")
    sys.path.insert(0, os.path.abspath(path))
    return {name: importlib.import_module(f"{OPS_PACKAGE}.{name}") for name in OPS_MODULES}


def vllm_version(path: str) -> str:
    """The vLLM release the ops in ``path`` came from (MANIFEST.json), or "unknown"."""
    try:
        with open(os.path.join(path, "MANIFEST.json")) as f:
            return json.load(f)["vllm_version"]
    except (OSError, KeyError, ValueError):
        return "unknown"


# -- launch configs ----------------------------------------------------------------------------


def use_configs(mode: str, folder: str | None) -> None:
    """Before the first launch: "tuned" points vLLM at ``folder``; "default" unsets the variable,
    which makes vLLM use its built-in default configs."""
    if mode not in CONFIG_MODES:
        raise ValueError(f"vLLM config mode {mode!r}: use one of {', '.join(CONFIG_MODES)}")
    if mode == "tuned":
        if not folder or not os.path.isdir(folder):
            raise ValueError(f"tuned-config folder {folder!r} does not exist: pass --vllm-config-dir DIR, "
                             "or --vllm-configs default")
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = os.path.abspath(folder)
    else:
        os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)


def tuned_config_name(device_name: str, op: str, add_inputs: bool | None = None) -> str:
    """The file name vLLM looks for: ``NVIDIA H100 80GB HBM3``, shrink -> NVIDIA_H100_80GB_HBM3_SHRINK.json."""
    gpu = device_name.replace(" ", "_").replace("-", "_")
    if op == "shrink":
        return f"{gpu}_SHRINK.json"
    if op == "expand":
        return f"{gpu}_EXPAND_{str(add_inputs).upper()}.json"
    raise ValueError(f"LoRA op {op!r}: use 'shrink' or 'expand'")


@contextmanager
def device_named(name: str) -> Iterator[None]:
    """Make torch.cuda.get_device_name() answer ``name`` (to check the tuned-file lookup on a CPU)."""
    real = torch.cuda.get_device_name
    torch.cuda.get_device_name = lambda device=None: name
    try:
        yield
    finally:
        torch.cuda.get_device_name = real


def reset_config_caches(mods: dict) -> None:
    """vLLM caches the loaded file and each lookup (functools.lru_cache): clear both after changing
    VLLM_TUNED_CONFIG_FOLDER or the device name within one process."""
    mods["utils"].load_lora_op_config.cache_clear()
    mods["utils"].get_lora_op_configs.cache_clear()


def config_sources(mods: dict, device_name: str) -> dict[str, str]:
    """Which configs vLLM uses on ``device_name``, asked of vLLM's own loader: per op the tuned file
    it loaded, or "default" when VLLM_TUNED_CONFIG_FOLDER is unset or holds no file for it.

    :raises RuntimeError: vLLM's answer disagrees with the file we expect (its naming changed).
    """
    folder = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    sources = {}
    with device_named(device_name):
        for op, add_inputs in (("shrink", None), ("expand", EXPAND_ADD_INPUTS)):
            loaded = mods["utils"].load_lora_op_config(op, add_inputs) is not None
            name = tuned_config_name(device_name, op, add_inputs)
            if loaded != (folder is not None and os.path.exists(os.path.join(folder, name))):
                raise RuntimeError(f"vLLM {'loaded' if loaded else 'did not load'} a tuned {op} config against "
                                   f"{name!r} in {folder!r}: its file naming changed; update tuned_config_name")
            sources[op] = name if loaded else "default"
    return sources


def kernel_configs(mods: dict, keys: dict[str, dict]) -> dict[str, dict]:
    """The launch configs vLLM's ops pick for ``keys``: {op: get_lora_op_configs keyword arguments}."""
    return {op: dict(mods["utils"].get_lora_op_configs(**k)) for op, k in keys.items()}


class VLLMSide:
    """vLLM's ops on one case: per-slice weight lists, its metadata, its [n, T, R] intermediate.
    ``specialize``: its metadata's grid over the active adapters only (else over max_loras + 1)."""

    def __init__(self, mods, x, A, B, sizes, slots, S, specialize):
        self.m = mods
        # its pointer caches are keyed by data_ptr: clear them, a freed case's address may be reused
        mods["utils"]._LORA_A_PTR_DICT.clear()
        mods["utils"]._LORA_B_PTR_DICT.clear()
        n, R, H = len(sizes), A.shape[1] // len(sizes), A.shape[2]
        self.a = [A.view(S, n, R, H)[:, i].contiguous() for i in range(n)]
        self.b = [t.contiguous() for t in torch.split(B, list(sizes), dim=1)]
        self.T = x.shape[0]
        meta = mods["lora_kernel_metadata"].LoRAKernelMeta.make(max_loras=S, max_num_tokens=self.T, device=x.device)
        meta.prepare_tensors(slots)
        self.meta, self.args = meta, meta.meta_args(self.T, specialize_active_lora=specialize)
        self.out = torch.empty(n, self.T, R, dtype=torch.float32, device=x.device)

    def config_keys(self) -> dict[str, dict]:
        """get_lora_op_configs' arguments for this case, taken from the tensors as vLLM's ops take them."""
        lora_ids = self.args[4]  # [max_loras + 1]: vLLM keys its tuned files by this length
        rank, hidden = self.a[0].shape[-2:]
        common = dict(max_loras=lora_ids.size(0), batch=self.T, rank=rank, num_slices=len(self.a))
        return {"shrink": dict(op_type="shrink", hidden_size=hidden, **common),
                "expand": dict(op_type="expand", hidden_size=max(b.size(1) for b in self.b),
                               add_inputs=EXPAND_ADD_INPUTS, **common)}

    def shrink(self, x):
        self.m["lora_shrink_op"].lora_shrink(x, self.a, self.out, *self.args, SCALE)
        return self.out

    def expand(self, y, buf):
        self.m["lora_expand_op"].lora_expand(buf, self.b, y, *self.args, offset_start=0, add_inputs=EXPAND_ADD_INPUTS)


# -- fetching ----------------------------------------------------------------------------------


def download_wheel(version: str, into: str) -> str:
    """``pip download`` the vLLM wheel (no dependencies) into ``into``; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:", "-d", into]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd)
    wheels = [f for f in os.listdir(into) if f.startswith("vllm-") and f.endswith(".whl")]
    if done.returncode != 0 or not wheels:
        sys.exit(f"pip could not download vllm=={version} (exit {done.returncode}). This needs PyPI access; "
                 "elsewhere, download the wheel and pass --wheel PATH.")
    return os.path.join(into, wheels[0])


def extract(wheel_path: str, dest: str) -> dict:
    """Write the ops and the shims into ``dest``, replaced as a whole (a half-written folder is
    never what the benchmark finds); returns the manifest."""
    with zipfile.ZipFile(wheel_path) as wheel:
        names = wheel.namelist()
        missing = [f for f in OPS_FILES if OPS_DIR + f not in names]
        if missing:
            sys.exit(f"{os.path.basename(wheel_path)} lacks {', '.join(OPS_DIR + f for f in missing)}: vLLM moved its "
                     "LoRA ops; pin a release that has them in VLLM_VERSION")
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        version = next(line.split(":", 1)[1].strip() for line in wheel.read(metadata).decode().splitlines()
                       if line.startswith("Version:"))
        license_name = next((n for n in names if n.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE"))), None)
        staging = dest + ".partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "vllm_shims", "vllm"), os.path.join(staging, "vllm"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        for init in PACKAGE_INITS:
            os.makedirs(os.path.dirname(os.path.join(staging, init)), exist_ok=True)
            with open(os.path.join(staging, init), "w") as f:
                f.write('"""Empty: only the LoRA Triton ops are copied (benchmarks/vllm_ops.py)."""\n')
        copied = {}
        for member in (OPS_DIR + f for f in OPS_FILES):
            data = wheel.read(member)
            with open(os.path.join(staging, member), "wb") as f:
                f.write(data)
            copied[member] = hashlib.sha256(data).hexdigest()
        if license_name:
            with open(os.path.join(staging, "LICENSE.vllm"), "wb") as f:
                f.write(wheel.read(license_name))
    manifest = {"vllm_version": version, "wheel": os.path.basename(wheel_path), "files_sha256": copied}
    with open(os.path.join(staging, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Fetch vLLM's multi-LoRA Triton ops for benchmarks/kernels.py")
    ap.add_argument("--dest", default=DEFAULT_OPS, help="output folder (replaced)")
    ap.add_argument("--wheel", help="a vLLM wheel already on disk (skips the download)")
    ap.add_argument("--version", default=VLLM_VERSION, help=f"vLLM release to download (default {VLLM_VERSION})")
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.dest)), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        wheel = args.wheel or download_wheel(args.version, tmp)
        if not os.path.isfile(wheel):
            sys.exit(f"--wheel {wheel!r} is not a file; pass the path of a vllm-*.whl")
        manifest = extract(wheel, args.dest)
    print(f"vLLM {manifest['vllm_version']} LoRA ops -> {args.dest}")


if __name__ == "__main__":
    main()
