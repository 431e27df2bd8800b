"""`current_platform`: CUDA or not, and the device's compute capability, from torch."""

from __future__ import annotations

import torch


class _TorchPlatform:
    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    @staticmethod
    def _code(device_id: int) -> int | None:
        """The device's capability as vLLM's int form (major * 10 + minor), None without CUDA."""
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return major * 10 + minor

    @classmethod
    def has_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = cls._code(device_id)
        return current is not None and current >= _as_code(capability)

    @classmethod
    def is_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = cls._code(device_id)
        return current is not None and current == _as_code(capability)


def _as_code(capability: tuple[int, int] | int) -> int:
    return capability[0] * 10 + capability[1] if isinstance(capability, tuple) else capability


current_platform = _TorchPlatform()
