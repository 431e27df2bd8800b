"""What an adapter is and where it lives: requests, config, loading and validation, the CPU tier,
and the name -> adapter registry."""

from loramux.registry.adapter import LoRAAdapter, LoRAModuleWeights
from loramux.registry.config import LoRAConfig
from loramux.registry.cpu_cache import CacheStats, CPUAdapterCache
from loramux.registry.loader import load_adapter
from loramux.registry.registry import AdapterLocation, Registry
from loramux.registry.request import LoRARequest, validate_adapter_name

__all__ = [
    "AdapterLocation",
    "CPUAdapterCache",
    "CacheStats",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRAModuleWeights",
    "LoRARequest",
    "Registry",
    "load_adapter",
    "validate_adapter_name",
]
