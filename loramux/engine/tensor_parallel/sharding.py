"""Shard a Hugging Face decoder's layers over the ranks, Megatron style, by a declared mapping.

Column-parallel (:data:`COLUMN_PARALLEL`: q/k/v, gate/up) layers keep the rows of their output
that belong to this rank: its attention heads (``num_heads / N`` query heads, ``num_kv_heads / N``
key/value heads), its share of the MLP's intermediate width. Row-parallel layers
(:data:`ROW_PARALLEL`: o, down) keep the matching columns of their input and are followed by an
all-reduce of their output (`RowParallelLinear`). Embeddings, norms and ``lm_head`` are
replicated: every rank computes the full logits, and rank 0 samples from its own.

The modeling code runs unchanged on a shard: Llama-style attention reshapes its projections with
``view(*shape, -1, head_dim)``, so it finds as many heads as the rank holds, and our attention op
reads the head counts from the tensors. The config's head counts are divided afterwards, so the
paged KV cache of a rank holds its key/value heads only.

Sharding runs before :func:`~loramux.engine.worker.siblings.fuse_siblings` (each rank fuses its own
q/k/v heads and gate/up rows into one GEMM) and before LoRA wraps the layers. Each shard carries
``loramux_tp`` (a `ShardSpec`), which the LoRA wrappers read to shard adapters the same way
(S-LoRA): column layers keep A whole and their rows of B, row layers their columns of A and B
whole, so a row layer's LoRA delta is added before its all-reduce and costs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from loramux.engine.quantization.fp8 import Fp8Linear
from loramux.engine.tensor_parallel.group import all_reduce

Linear = nn.Linear | Fp8Linear  # what the mapping's layers may be

__all__ = ["COLUMN_PARALLEL", "ROW_PARALLEL", "SHARDED_BLOCKS", "RowParallelLinear", "ShardSpec", "shard_config",
           "shard_model"]

#: the sharded blocks, by attribute name inside one parent module: the column-parallel layers
#: (output split over the ranks) and the row-parallel layer reading their result (input split,
#: output all-reduced). A parent holding any of a block's layers must hold all of them.
SHARDED_BLOCKS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "o_proj"),  # attention: whole heads per rank
    (("gate_proj", "up_proj"), "down_proj"),  # MLP: a share of the intermediate width per rank
)
COLUMN_PARALLEL: tuple[str, ...] = tuple(name for columns, _ in SHARDED_BLOCKS for name in columns)
ROW_PARALLEL: tuple[str, ...] = tuple(row for _, row in SHARDED_BLOCKS)


@dataclass(frozen=True)
class ShardSpec:
    """How a layer is split: ``style`` "column" (output rows) or "row" (input columns), and
    which of ``size`` equal parts this rank (``rank``) holds."""

    style: Literal["column", "row"]
    rank: int
    size: int


class RowParallelLinear(nn.Module):
    """A row-parallel layer: ``linear`` holds this rank's input columns (no bias); the partial
    outputs (LoRA's included: LoRA wraps ``linear``) are summed over the ranks, then the bias
    is added once."""

    def __init__(self, linear: Linear, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = linear.in_features  # this rank's
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.linear(x).contiguous())  # [T, out], summed in place
        return y if self.bias is None else y + self.bias


def shard_config(config, size: int) -> None:
    """Make ``config`` describe one rank's share of the model (``size`` ranks): a model built
    from it *is* a shard (its heads, its MLP width), to be marked with
    ``shard_model(..., prebuilt=True)``. So a random-weight model of any size builds in its
    share of memory; its shards are random, not those of the TP=1 model of that config.

    :raises ValueError: ``size`` does not divide a head count or the MLP width.
    """
    config = config.get_text_config()
    _check_divisible(config, size)
    _divide(config, size)
    config.intermediate_size //= size


@torch.no_grad()
def shard_model(model: nn.Module, rank: int, size: int, *, prebuilt: bool = False) -> list[str]:
    """Keep, in place, rank ``rank``'s part of every declared layer of ``model``; returns their names.

    With ``prebuilt`` the model was built from a `shard_config` config: its layers already have
    a shard's sizes, and are only marked (and the row layers wrapped for their all-reduce).

    :raises ValueError: the head counts or the MLP width do not divide by ``size``, or the model
        has no layer of the mapping, or only some (an architecture this mapping does not cover).
    """
    config = model.config.get_text_config()
    if not prebuilt:
        _check_divisible(config, size)
    sharded, problems = [], []
    for parent_name, parent in list(model.named_modules()):
        prefix = f"{parent_name}." if parent_name else ""
        for columns, row in SHARDED_BLOCKS:
            layers = {attr: getattr(parent, attr, None) for attr in (*columns, row)}
            if all(layer is None for layer in layers.values()):
                continue
            odd = [f"{prefix}{attr} ({'missing' if layer is None else type(layer).__name__})"
                   for attr, layer in layers.items() if type(layer) not in (nn.Linear, Fp8Linear)]
            if odd:  # e.g. a fused qkv_proj beside o_proj: this mapping cannot split its heads
                problems.extend(odd)
                continue
            for attr in columns:
                setattr(parent, attr, _column_shard(layers[attr], rank, size, prebuilt))
            setattr(parent, row, _row_shard(layers[row], prefix + row, rank, size, prebuilt))
            sharded.extend(prefix + attr for attr in (*columns, row))
    if not sharded or problems:
        found = f"; not plain nn.Linear (or FP8) layers of that mapping: {', '.join(problems[:4])}" if problems else ""
        raise ValueError(
            f"tensor parallelism shards the layers named {', '.join(COLUMN_PARALLEL + ROW_PARALLEL)} "
            f"(Llama, Qwen2, Mistral, Gemma and kin); {type(model).__name__} has {len(sharded)} of them"
            f"{found}. Serve this model with tensor_parallel_size=1."
        )
    if not prebuilt:
        _divide(config, size)
    return sharded


def _check_divisible(config, size: int) -> None:
    heads = config.num_attention_heads
    for what, value in (("num_attention_heads", heads),
                        ("num_key_value_heads", getattr(config, "num_key_value_heads", None) or heads),
                        ("intermediate_size", getattr(config, "intermediate_size", None))):
        if value is not None and value % size:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide the model's {what}={value}: each rank "
                f"must hold a whole share; use a tensor_parallel_size that divides it."
            )


def _divide(config, size: int) -> None:
    """What the rank holds from now on: the KV cache, and anything else reading the config,
    sizes its heads by these (head_dim is pinned first, as it may be derived from the heads)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    config.num_attention_heads = heads // size
    config.num_key_value_heads = kv_heads // size


def _column_shard(layer: Linear, rank: int, size: int, prebuilt: bool = False) -> Linear:
    if prebuilt:
        shard = layer
    else:
        rows = layer.out_features // size
        shard = _part(layer, rows=slice(rank * rows, (rank + 1) * rows))
    shard.loramux_tp = ShardSpec("column", rank, size)
    return shard


def _row_shard(layer: Linear, name: str, rank: int, size: int, prebuilt: bool = False) -> RowParallelLinear:
    columns = layer.in_features if prebuilt else layer.in_features // size
    start = 0 if prebuilt else rank * columns
    shard = _part(layer, columns=slice(start, start + columns), keep_bias=False)
    shard.loramux_tp = ShardSpec("row", rank, size)
    # LoRA wraps the inner layer, which stands for the module adapters name (PEFT's o_proj)
    shard.loramux_slices = ((name, layer.out_features),)
    return RowParallelLinear(shard, None if layer.bias is None else layer.bias.clone())


def _part(layer: Linear, rows: slice = slice(None), columns: slice = slice(None), *, keep_bias: bool = True) -> Linear:
    """A layer of the same kind owning a copy of ``layer``'s ``rows`` and ``columns`` (so the full
    layer's memory is freed); an FP8 layer keeps its rows' scales (`Fp8Linear.part`)."""
    if isinstance(layer, Fp8Linear):
        return layer.part(rows, columns, keep_bias=keep_bias)
    weight = layer.weight[rows, columns]
    bias = None if layer.bias is None or not keep_bias else layer.bias[rows]
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return linear
