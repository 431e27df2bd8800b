"""What an adapter is and where it lives: requests, config, loading and validation, handles,
the CPU tier, and the name -> handle registry."""

from loramux.registry.adapter import LoRAAdapter, LoRAModuleWeights
from loramux.registry.config import LoRAConfig, default_cpu_lora_bytes
from loramux.registry.cpu_cache import CacheStats, CPUAdapterCache
from loramux.registry.handle import AdapterHandle
from loramux.registry.loader import load_adapter, load_adapter_with_digest
from loramux.registry.registry import Registry
from loramux.registry.request import LoRARequest, validate_adapter_name
from loramux.registry.sources import AdapterLocation

__all__ = [
    "AdapterHandle",
    "AdapterLocation",
    "CPUAdapterCache",
    "CacheStats",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRAModuleWeights",
    "LoRARequest",
    "Registry",
    "default_cpu_lora_bytes",
    "load_adapter",
    "load_adapter_with_digest",
    "validate_adapter_name",
]
