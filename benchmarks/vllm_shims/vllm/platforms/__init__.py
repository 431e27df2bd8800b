"""`current_platform`: CUDA or not, and the device's compute capability, from torch."""

from __future__ import annotations

import torch


class _TorchPlatform:
    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    @staticmethod
    def _capability(device_id: int) -> tuple[int, int] | None:
        return torch.cuda.get_device_capability(device_id) if torch.cuda.is_available() else None

    @classmethod
    def has_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = cls._capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current >= capability
        return current[0] * 10 + current[1] >= capability

    @classmethod
    def is_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        current = cls._capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current == capability
        return current[0] * 10 + current[1] == capability


current_platform = _TorchPlatform()
