"""Fetch vLLM's multi-LoRA Triton ops (and any tuned LoRA kernel configs its wheel ships) into
`.thirdparty/vllm_lora/` for benchmarks/compare_vllm.py. Standard library and pip only.

    python benchmarks/fetch_vllm_lora_ops.py                 # pip-downloads the pinned wheel
    python benchmarks/fetch_vllm_lora_ops.py --wheel W.whl   # or reads a wheel already on disk

The result is vLLM's own, unmodified `vllm/lora/ops/triton_ops/{lora_shrink_op, lora_expand_op,
kernel_utils, lora_kernel_metadata, utils}.py` (with the wheel's LICENSE and README_TUNING.md), our
shims for the `vllm.*` modules they import (benchmarks/vllm_shims/), `configs/` with every tuned
LoRA config JSON found under `vllm/lora/` in the wheel, and MANIFEST.json (version, sha256 of each
copied file). About 80 kB: small enough to carry to a GPU machine that has no network. The folder
is git-ignored and never committed.

Why VLLM_VERSION is what it is: 0.33.0 is the newest release on PyPI (2026-11). Its five files
import nothing beyond torch, triton and the shimmed `vllm.*` names, and use `tl.extra.cuda.gdc_wait`
/ `gdc_launch_dependents` only under a constexpr that is off unless VLLM_LORA_ENABLE_DUAL_STREAM is
set (both exist since Triton 3.4). It imports and passes `compare_vllm.py --check-cpu` under the
Triton interpreter with Triton 3.6.0 (the GPU machine's; its interpreter needs numpy < 2.4) and
3.9.0 (this project's CPU venv).
The wheel pins torch 2.14, but only for vLLM itself: these files use plain torch ops
(sort, unique, cumsum, inference_mode) that torch 2.11 has.

Tuned configs: vLLM reads them from the folder named by VLLM_TUNED_CONFIG_FOLDER, file
`<torch.cuda.get_device_name() with " " and "-" -> "_">_SHRINK.json` and `..._EXPAND_<TRUE|FALSE>.json`
(vllm/lora/ops/triton_ops/utils.py, `load_lora_op_config`). No released wheel ships such files
(none under vllm/lora/ in 0.7.2, 0.7.3, 0.8.0, 0.8.5, 0.9.2, 0.10.1.1, 0.10.2, 0.11.0, 0.15.0,
0.20.0, 0.25.0, 0.30.0, 0.32.0, 0.33.0): the script says so and leaves `configs/` empty,
compare_vllm.py then reports vLLM's config source as "default", and benchmarks/tune_vllm_lora.py
makes the files on the GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

VLLM_VERSION = "0.33.0"
OPS_DIR = "vllm/lora/ops/triton_ops/"
OPS_FILES = ("lora_shrink_op.py", "lora_expand_op.py", "kernel_utils.py", "lora_kernel_metadata.py", "utils.py")
DOC_FILES = ("README_TUNING.md",)
# empty package markers: vLLM's own __init__.py files import the whole package (fused MoE, models)
PACKAGE_INITS = ("vllm/lora/__init__.py", "vllm/lora/ops/__init__.py", OPS_DIR + "__init__.py")
HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(HERE, "vllm_shims")


def download_wheel(version: str, into: str) -> str:
    """`pip download` the vLLM wheel (no dependencies) into `into`; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
           "-d", into]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd)
    wheels = [f for f in os.listdir(into) if f.startswith("vllm-") and f.endswith(".whl")]
    if done.returncode != 0 or not wheels:
        sys.exit(f"pip could not download vllm=={version} (exit {done.returncode}). This needs PyPI access; "
                 "on a machine without it, download the wheel elsewhere and pass --wheel PATH.")
    return os.path.join(into, wheels[0])


def tuned_config_members(names: list[str]) -> list[str]:
    """The wheel's tuned LoRA kernel config files: JSON under vllm/lora/ (vLLM names them
    `<GPU>_SHRINK.json`, `<GPU>_EXPAND_TRUE.json`, ...), wherever below vllm/lora/ they sit."""
    return sorted(n for n in names if n.startswith("vllm/lora/") and n.endswith(".json"))


def wheel_version(wheel: zipfile.ZipFile) -> str:
    for name in wheel.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in wheel.read(name).decode().splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    sys.exit("the wheel has no .dist-info/METADATA with a Version: line; is it a vLLM wheel?")


def extract(wheel_path: str, dest: str) -> dict:
    """Write the ops, the shims and the tuned configs into `dest` (replaced as a whole)."""
    with zipfile.ZipFile(wheel_path) as wheel:
        names = wheel.namelist()
        missing = [f for f in OPS_FILES if OPS_DIR + f not in names]
        if missing:
            sys.exit(f"{os.path.basename(wheel_path)} lacks {', '.join(OPS_DIR + f for f in missing)}: "
                     f"vLLM moved its LoRA ops; pin a release that has them in {os.path.basename(__file__)}")
        version = wheel_version(wheel)
        license_name = next((n for n in names if n.endswith(".dist-info/licenses/LICENSE")
                             or n.endswith(".dist-info/LICENSE")), None)
        staging = dest + ".partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(os.path.join(SHIMS, "vllm"), os.path.join(staging, "vllm"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        for init in PACKAGE_INITS:
            path = os.path.join(staging, init)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write('"""Empty: only the LoRA Triton ops are copied (benchmarks/fetch_vllm_lora_ops.py)."""\n')
        copied = {}
        members = [OPS_DIR + f for f in OPS_FILES] + [OPS_DIR + f for f in DOC_FILES if OPS_DIR + f in names]
        for member in members:
            data = wheel.read(member)
            with open(os.path.join(staging, member), "wb") as f:
                f.write(data)
            copied[member] = hashlib.sha256(data).hexdigest()
        os.makedirs(os.path.join(staging, "configs"))
        configs = []
        for member in tuned_config_members(names):
            data = wheel.read(member)
            with open(os.path.join(staging, "configs", os.path.basename(member)), "wb") as f:
                f.write(data)
            copied[member] = hashlib.sha256(data).hexdigest()
            configs.append(os.path.basename(member))
        if license_name:
            with open(os.path.join(staging, "LICENSE.vllm"), "wb") as f:
                f.write(wheel.read(license_name))
    manifest = {"vllm_version": version, "wheel": os.path.basename(wheel_path), "files_sha256": copied,
                "tuned_configs": configs, "shims": "benchmarks/vllm_shims (loramux)"}
    with open(os.path.join(staging, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)  # a half-written folder is never what compare_vllm.py finds
    return manifest


def folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", default=".thirdparty/vllm_lora", help="output folder (replaced)")
    ap.add_argument("--wheel", help="a vLLM wheel already on disk (skips the download)")
    ap.add_argument("--version", default=VLLM_VERSION,
                    help=f"vLLM release to download (default: the pinned {VLLM_VERSION})")
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.dest)), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        wheel = args.wheel or download_wheel(args.version, tmp)
        if not os.path.isfile(wheel):
            sys.exit(f"--wheel {wheel!r} is not a file; pass the path of a vllm-*.whl")
        manifest = extract(wheel, args.dest)
    print(f"vLLM {manifest['vllm_version']} LoRA ops -> {args.dest} ({folder_size(args.dest) / 1024:.0f} kB)")
    if manifest["tuned_configs"]:
        print("tuned LoRA kernel configs found in the wheel:", ", ".join(manifest["tuned_configs"]))
    else:
        print("tuned LoRA kernel configs found in the wheel: none (vLLM reads them only from "
              "VLLM_TUNED_CONFIG_FOLDER; compare_vllm.py will report 'default')")


if __name__ == "__main__":
    main()
