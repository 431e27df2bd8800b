"""Quantized base models: FP8 projections (`Fp8Linear`), made from an unquantized checkpoint as it
loads (``quantization="fp8"``) or read from a checkpoint saved in FP8."""

from loramux.engine.quantization.checkpoint import SUPPORTED_CHECKPOINTS, checkpoint_format, load_fp8_checkpoint
from loramux.engine.quantization.fp8 import (Fp8Linear, check_fp8_device, has_fp8_layers, quantizable,
                                             quantize_model, require_fp8_layers)

__all__ = [
    "SUPPORTED_CHECKPOINTS",
    "Fp8Linear",
    "check_fp8_device",
    "checkpoint_format",
    "has_fp8_layers",
    "load_fp8_checkpoint",
    "quantizable",
    "quantize_model",
    "require_fp8_layers",
]
