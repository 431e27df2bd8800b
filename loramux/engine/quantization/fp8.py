"""`Fp8Linear`: a projection whose weight is stored in FP8 (e4m3), and quantizing a model's
projections into it as they load.

vLLM's default FP8 scheme: one float32 scale per output channel of the weight, the activations
quantized per token when they arrive, one FP8 GEMM (`loramux.kernels.dispatch.fp8_gemm`: on CUDA
our decode-sized Triton GEMM up to 64 rows, cuBLASLt's ``torch._scaled_mm`` past them; the torch
reference elsewhere). The layer takes and returns activations in the model's dtype
(``activation_dtype``), so everything around it, LoRA included, reads what it would read from an
``nn.Linear``: a LoRA wrapper's shrink reads the same activations the GEMM quantizes, and an
adapter trained on the unquantized model adds the same delta.

The GEMM is one opaque op (``loramux::fp8_gemm``). The quantize before it is one launch of its
own when the layer runs eagerly; in a ``torch.compile`` trace it is torch ops
(`quantize_per_token_ref`), which inductor fuses into the kernel that wrote the activations, so
they are read once, not twice. A LoRA wrapper's op takes the quantized activations from the
traced code too (`BaseLayerWithLoRA.base_inputs`).

Which layers: every plain ``nn.Linear`` but the model's output embeddings (``lm_head``), whose
widths are multiples of 16 (what cuBLASLt's FP8 GEMM takes); embeddings, norms and ``lm_head``
keep the model's dtype. FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loramux.errors import QuantizationError
from loramux.kernels.dispatch import fp8_gemm, quantize_per_token
from loramux.kernels.fp8_reference import FP8_DTYPE, quantize_per_token_ref

__all__ = ["Fp8Linear", "check_fp8_device", "has_fp8_layers", "quantizable", "quantize_model", "release_cached",
           "require_fp8_layers"]

logger = logging.getLogger(__name__)

#: cuBLASLt's FP8 GEMM takes K and N in multiples of this
FP8_ALIGNMENT = 16
MIN_CAPABILITY = (8, 9)


class Fp8Linear(nn.Module):
    """``y = x @ (weight * weight_scale[:, None]).T + bias``, ``x`` quantized per token first.

    :param weight: ``[out, in]`` ``float8_e4m3fn``.
    :param weight_scale: ``[out]`` float32, one scale per output channel.
    :param bias: ``[out]`` in ``activation_dtype``, or None.
    :param activation_dtype: the dtype of the activations it takes and returns (the model's).
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 activation_dtype: torch.dtype) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8Linear: weight must be a 2-D {FP8_DTYPE}, got {weight.dtype} {list(weight.shape)}")
        if weight_scale.shape != weight.shape[:1] or weight_scale.dtype != torch.float32:
            raise ValueError(f"Fp8Linear: weight_scale must be float32 [{weight.shape[0]}], got "
                             f"{weight_scale.dtype} {list(weight_scale.shape)}")
        self.out_features, self.in_features = weight.shape
        self.activation_dtype = activation_dtype
        # parameters, as an nn.Linear's: what counts a model's weights (``model.parameters()``) counts them
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(activation_dtype), requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, device: torch.device | str | None = None) -> Fp8Linear:
        """``linear`` quantized, one scale per output channel, on ``device`` (default: its own).
        The quantization runs there, so a layer read into host memory reaches the GPU in FP8."""
        weight = linear.weight.to(device) if device is not None else linear.weight
        # an output channel is a row; on CUDA one launch that allocates only its outputs, so the
        # FP8 weight is never carved from a float32 temporary's freed memory (`release_cached`)
        weight_q, scale = quantize_per_token(weight)
        bias = None if linear.bias is None else linear.bias.to(weight.device)
        return cls(weight_q, scale.view(-1), bias, linear.weight.dtype)

    @classmethod
    def concat(cls, layers: list[Fp8Linear]) -> Fp8Linear:
        """One layer computing ``layers``' outputs side by side (fused siblings)."""
        first = layers[0]
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
        return cls(torch.cat([layer.weight for layer in layers]), torch.cat([layer.weight_scale for layer in layers]),
                   bias, first.activation_dtype)

    def part(self, rows: slice = slice(None), columns: slice = slice(None), *, keep_bias: bool = True) -> Fp8Linear:
        """A copy of these output ``rows`` and input ``columns`` (a tensor-parallel shard; the
        scales are the whole layer's, so its shards compute the whole layer's products)."""
        bias = None if self.bias is None or not keep_bias else self.bias[rows].clone()
        return type(self)(self.weight[rows, columns].clone(memory_format=torch.contiguous_format),
                          self.weight_scale[rows].clone(), bias, self.activation_dtype)

    def _apply(self, fn, recurse=True):
        # model.to(device) moves the FP8 weight and its scales; a cast (model.half(),
        # model.to(torch.bfloat16)) reaches the bias and the activations only: the weight goes
        # through as bytes and the scales as int32 bits, which casts leave alone
        super()._apply(lambda t: t if t is self.weight or t is self.weight_scale else fn(t), recurse)
        self.weight.data = fn(self.weight.data.view(torch.uint8)).view(FP8_DTYPE)
        self.weight_scale.data = fn(self.weight_scale.data.view(torch.int32)).view(torch.float32)
        self.activation_dtype = fn(torch.empty(0, dtype=self.activation_dtype)).dtype
        return self

    def dequantize(self) -> torch.Tensor:
        """The weight this layer stands for, ``[out, in]`` float32."""
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_quantized(x, *self.quantize_input(x))

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., in]`` quantized per token: ``(xq [M, in] FP8, x_scale [M, 1] float32)``.
        Compiled, torch ops, which inductor fuses into the kernel that made x (the RMSNorm, the
        SiLU-mul), so x is read once less than by a quantize launch of its own (eagerly)."""
        x2d = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():
            return quantize_per_token_ref(x2d)
        return quantize_per_token(x2d if x2d.stride(-1) == 1 else x2d.contiguous())

    def apply_quantized(self, x: torch.Tensor, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``x``, from its `quantize_input`."""
        y = torch.ops.loramux.fp8_gemm(xq, x_scale, self.weight, self.weight_scale, x.dtype)
        # [..., N] as a tensor of its own, not a view, as F.linear returns it: callers write into
        # a layer's output in place (the LoRA delta, a tensor-parallel all-reduce)
        y = torch.ops.aten._unsafe_view(y, (*x.shape[:-1], self.out_features))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation_dtype={self.activation_dtype}")


@torch.library.custom_op("loramux::fp8_gemm", mutates_args=())
def _fp8_gemm_op(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_gemm(xq, x_scale, weight, weight_scale, out_dtype)


@_fp8_gemm_op.register_fake
def _(xq, x_scale, weight, weight_scale, out_dtype) -> torch.Tensor:
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


def check_fp8_device(device: torch.device | str) -> None:
    """Refuse a CUDA device without FP8 GEMMs (compute capability below 8.9).

    :raises QuantizationError: naming the device, its capability and what to do.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return  # the torch reference runs anywhere
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise QuantizationError(
            f"FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) for "
            f"their FP8 GEMMs; {device} ({torch.cuda.get_device_name(device)}) has compute capability "
            f"{major}.{minor}.",
            fix="Serve the unquantized (bf16/fp16) checkpoint without quantization='fp8' "
                "(--quantization fp8), or use a GPU that has FP8.",
        )


def quantizable(module: nn.Module) -> bool:
    """Whether ``module`` is a projection `quantize_model` turns into an `Fp8Linear`."""
    return (type(module) is nn.Linear and module.in_features % FP8_ALIGNMENT == 0
            and module.out_features % FP8_ALIGNMENT == 0)


@torch.no_grad()
def quantize_model(model: nn.Module, device: torch.device | str | None = None) -> list[str]:
    """Replace, in place, every quantizable projection of ``model`` (`quantizable`; never its
    output embeddings) by its `Fp8Linear`, one layer at a time, so a model read into host memory
    never holds a whole unquantized copy on ``device`` (default: each layer's own). Returns the
    names of the layers quantized.

    :raises QuantizationError: ``device`` (or the model's) is a GPU without FP8.
    """
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    quantized, kept = [], []
    # names, not modules: a replaced layer is freed at once
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear and module is not output]
    for name in names:
        module = model.get_submodule(name)
        if not quantizable(module):
            kept.append(name)
            continue
        if not quantized:
            check_fp8_device(device if device is not None else module.weight.device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Fp8Linear.from_linear(module, device))
        quantized.append(name)
        release_cached(device if device is not None else module.weight.device)
    if kept:
        logger.info("FP8: %d projections keep the model's dtype (a width not a multiple of %d): %s",
                    len(kept), FP8_ALIGNMENT, ", ".join(kept[:8]) + (" ..." if len(kept) > 8 else ""))
    require_fp8_layers(model)
    return quantized


def release_cached(device: torch.device | str) -> None:
    """Give the memory of weights just replaced back to the device (CUDA).

    Without it the next layer's new weight is carved from the freed memory of the one replaced,
    and the rest of that block stays reserved, so the KV cache, sized from the device's free
    memory, would get only part of what a smaller weight frees."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is an `Fp8Linear`."""
    return any(isinstance(module, Fp8Linear) for module in model.modules())


def require_fp8_layers(model: nn.Module) -> None:
    """Refuse a model asked to run in FP8 that has no FP8 layer (it would run unquantized).

    :raises QuantizationError: naming the model and the layers FP8 takes.
    """
    if not has_fp8_layers(model):
        raise QuantizationError(
            f"{type(model).__name__} has no projection to run in FP8: FP8 takes plain torch.nn.Linear layers "
            f"(not the output embeddings) whose widths are multiples of {FP8_ALIGNMENT}.",
            fix="Serve it without quantization='fp8' (--quantization fp8).",
        )
