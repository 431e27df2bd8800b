"""vLLM's environment switches that the LoRA ops read, parsed as vLLM 0.33's `vllm/envs.py` does.

Read lazily (module `__getattr__`, as vLLM does), so a variable set before the first lookup counts.
"""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return bool(int(os.getenv(name, "0")))


_READERS = {
    # a folder of `<GPU name>_SHRINK.json` / `<GPU name>_EXPAND_<TRUE|FALSE>.json`; unset: defaults
    "VLLM_TUNED_CONFIG_FOLDER": lambda: os.getenv("VLLM_TUNED_CONFIG_FOLDER", None),
    "VLLM_BATCH_INVARIANT": lambda: _flag("VLLM_BATCH_INVARIANT"),
    "VLLM_LORA_DISABLE_PDL": lambda: _flag("VLLM_LORA_DISABLE_PDL"),
    "VLLM_LORA_ENABLE_DUAL_STREAM": lambda: _flag("VLLM_LORA_ENABLE_DUAL_STREAM"),
}


def __getattr__(name: str):
    if name in _READERS:
        return _READERS[name]()
    raise AttributeError(f"vllm.envs shim has no {name!r}: add it to benchmarks/vllm_shims/vllm/envs.py "
                         "with vLLM's default, then rerun benchmarks/vllm_ops.py")
