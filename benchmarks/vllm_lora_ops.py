"""Load vLLM's LoRA Triton ops from the folder benchmarks/fetch_vllm_lora_ops.py writes, point them
at tuned kernel configs (or none), and say which configs they use: for benchmarks/compare_vllm.py.

vLLM picks its shrink/expand launch configs in `vllm/lora/ops/triton_ops/utils.py`:
`get_lora_op_configs(op, max_loras, batch, hidden_size, rank, num_slices, add_inputs)` returns a
built-in default unless VLLM_TUNED_CONFIG_FOLDER names a folder holding
`<GPU>_SHRINK.json` / `<GPU>_EXPAND_<TRUE|FALSE>.json`, where <GPU> is torch.cuda.get_device_name()
with " " and "-" turned into "_" (e.g. NVIDIA_H100_80GB_HBM3). A file is nested
`[max_loras][num_slices][m][k][n] -> config`, each level taking the exact key or else the nearest
one; the ops pass max_loras = LoRAKernelMeta's max_loras + 1 (the "no adapter" slot), m = tokens,
(k, n) = (hidden, rank) for shrink and (rank, widest slice) for expand. We set the variable and let
vLLM's own code do the lookup; `config_sources` reads back what it found.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from contextlib import contextmanager
from typing import Iterator

OPS_PACKAGE = "vllm.lora.ops.triton_ops"
OPS_MODULES = ("lora_shrink_op", "lora_expand_op", "lora_kernel_metadata", "utils")
CONFIG_MODES = ("tuned", "default")
DEFAULT_SOURCE = "default"
# compare_vllm.py calls expand as vLLM's Punica wrapper does for linear layers: y += ..., so the
# tuned expand file is the _EXPAND_TRUE one
EXPAND_ADD_INPUTS = True


def load_vllm(path: str) -> dict:
    """Import vLLM's ops from `path` (a fetch_vllm_lora_ops.py folder) as the package `vllm`.

    :returns: the modules {"lora_shrink_op", "lora_expand_op", "lora_kernel_metadata", "utils"}.
    """
    ops_dir = os.path.join(path, *OPS_PACKAGE.split("."))
    missing = [m + ".py" for m in OPS_MODULES if not os.path.exists(os.path.join(ops_dir, m + ".py"))]
    if missing or not os.path.exists(os.path.join(path, "vllm", "envs.py")):
        sys.exit(f"vLLM LoRA ops not found in {path!r} (missing: {', '.join(missing) or 'the vllm.* shims'}).\n"
                 "Fetch them once with `python benchmarks/fetch_vllm_lora_ops.py` (needs PyPI), carry the "
                 "folder to the GPU machine, or pass --vllm-ops DIR.")
    loaded = sys.modules.get("vllm")
    if loaded is not None and not os.path.abspath(getattr(loaded, "__file__", "") or "").startswith(
            os.path.abspath(path)):
        sys.exit(f"a different `vllm` is already imported ({loaded.__file__}); run compare_vllm.py in a "
                 "process that has not imported vLLM")
    sys.path.insert(0, os.path.abspath(path))
    return {name: importlib.import_module(f"{OPS_PACKAGE}.{name}") for name in OPS_MODULES}


def vllm_version(path: str) -> str:
    """The vLLM release the ops in `path` came from (MANIFEST.json), or "unknown"."""
    try:
        with open(os.path.join(path, "MANIFEST.json")) as f:
            return json.load(f)["vllm_version"]
    except (OSError, KeyError, ValueError):
        return "unknown"


def use_configs(mode: str, folder: str | None) -> None:
    """Before the first launch: "tuned" points vLLM at `folder`; "default" unsets the variable,
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
    """The file name vLLM looks for: `NVIDIA H100 80GB HBM3`, shrink -> NVIDIA_H100_80GB_HBM3_SHRINK.json."""
    gpu = device_name.replace(" ", "_").replace("-", "_")
    if op == "shrink":
        return f"{gpu}_SHRINK.json"
    if op == "expand":
        return f"{gpu}_EXPAND_{str(add_inputs).upper()}.json"
    raise ValueError(f"LoRA op {op!r}: use 'shrink' or 'expand'")


@contextmanager
def device_named(name: str) -> Iterator[None]:
    """Make torch.cuda.get_device_name() answer `name` (to check the tuned-file lookup on a CPU)."""
    import torch

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
    """Which configs vLLM uses on `device_name`, asked of vLLM's own loader: per op the tuned file
    name it loaded, or "default" when VLLM_TUNED_CONFIG_FOLDER is unset or holds no file for it."""
    folder = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    sources = {}
    with device_named(device_name):
        for op, add_inputs in (("shrink", None), ("expand", EXPAND_ADD_INPUTS)):
            loaded = mods["utils"].load_lora_op_config(op, add_inputs) is not None
            name = tuned_config_name(device_name, op, add_inputs)
            expected = folder is not None and os.path.exists(os.path.join(folder, name))
            if loaded != expected:
                raise RuntimeError(f"vLLM {'loaded' if loaded else 'did not load'} a tuned {op} config but "
                                   f"{name!r} is {'present' if expected else 'absent'} in {folder!r}: its "
                                   "file naming changed; update tuned_config_name in benchmarks/vllm_lora_ops.py")
            sources[op] = name if loaded else DEFAULT_SOURCE
    return sources


def kernel_configs(mods: dict, keys: dict[str, dict]) -> dict[str, dict]:
    """The launch configs vLLM's ops pick for `keys`: {op: get_lora_op_configs keyword arguments}."""
    return {op: dict(mods["utils"].get_lora_op_configs(**k)) for op, k in keys.items()}


def load_or_exit(args, check_cpu, no_cuda: str) -> dict:
    """The scripts' shared start: vLLM's ops from ``args.vllm_ops``; with ``--check-cpu`` run
    ``check_cpu(mods)`` and exit with its verdict; without CUDA exit saying ``no_cuda``."""
    import torch

    mods = load_vllm(args.vllm_ops)
    if args.check_cpu:
        sys.exit(0 if check_cpu(mods) else 1)
    if not torch.cuda.is_available():
        sys.exit(f"no CUDA device: {no_cuda}")
    return mods
