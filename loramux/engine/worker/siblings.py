"""Fused sibling projections: q/k/v (and gate/up) as one GEMM, in the model's own modeling code.

Projections that read the same input are computed by one matrix product over their concatenated
weights (made once, when the model is loaded): the first sibling the modeling code calls computes
the whole group and hands each sibling its slice, a view. Hugging Face's code still calls
``self.q_proj(x)``, ``self.k_proj(x)``, ``self.v_proj(x)``; nothing is forked per model. One fused
GEMM reads ``x`` once and runs near copy bandwidth where the narrow k/v products did not, and LoRA
wraps the fused layer once: adapters trained on the separate projections fill its slices, so a
group costs one shrink and one expand launch whatever its size.

Which groups exist is a small declared mapping (:data:`SIBLING_GROUPS`: attribute names inside one
parent module, in the order the modeling code calls them). A group is fused only when every member
is a plain ``nn.Linear`` (or every member an FP8 `Fp8Linear`, whose per-channel scales fuse as
they are) with the same input width, dtype, device and bias presence; anything else is left as it is.

The fused layer carries ``loramux_slices`` (the original module names and widths), which the
built-in LoRA hook reads to wrap it with one slice per sibling; a layer plugin can declare its own
fused layers the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from loramux.engine.quantization.fp8 import Fp8Linear, release_cached

__all__ = ["SIBLING_GROUPS", "FusedSiblings", "SiblingSlice", "fuse_siblings"]

#: (names inside one parent module), in the order the modeling code calls them
SIBLING_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),  # Mixtral-style expert MLPs
)


class FusedSiblings(nn.Module):
    """The group's one linear layer (``fused``) and the output of its last call, for the slices."""

    def __init__(self, fused: nn.Linear, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.fused = fused
        self.sizes = sizes
        self.offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None


class SiblingSlice(nn.Module):
    """What replaces one sibling: its slice of the group's output.

    The first member computes the group for a new input; the others take their slice of that
    result, and the last one lets it go. A call out of that order (a model that calls its
    siblings otherwise) still gets the right answer: it computes the group itself.
    """

    def __init__(self, group: FusedSiblings, index: int) -> None:
        super().__init__()
        # a plain attribute, not a submodule: the group is registered once, under the first member
        object.__setattr__(self, "group", group)
        self.index = index
        if index == 0:
            self.siblings = group
        self.in_features = group.fused.in_features
        self.out_features = group.sizes[index]

    @property
    def weight(self) -> torch.Tensor:  # code that reads `q_proj.weight` gets its own rows (a view)
        start = self.group.offsets[self.index]
        return self.group.fused.weight[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, i = self.group, self.index
        if i == 0 or group._output is None or group._input is not x:
            group._input, group._output = x, group.fused(x)
        start = group.offsets[i]
        out = group._output[..., start : start + group.sizes[i]]
        if i == len(group.sizes) - 1:
            group._input = group._output = None
        return out


def _fusable(members: list[nn.Module]) -> bool:
    first = members[0]
    if type(first) not in (nn.Linear, Fp8Linear) or any(type(m) is not type(first) for m in members):
        return False
    return all(
        m.in_features == first.in_features
        and getattr(m, "loramux_tp", None) == getattr(first, "loramux_tp", None)
        and m.weight.dtype == first.weight.dtype
        and getattr(m, "activation_dtype", None) == getattr(first, "activation_dtype", None)
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in members
    )


@torch.no_grad()
def fuse_siblings(model: nn.Module, groups: tuple[tuple[str, ...], ...] = SIBLING_GROUPS) -> list[str]:
    """Fuse every declared sibling group of ``model`` in place; returns the fused layers' names.

    Each fused weight is the members' weights concatenated (once; the originals are freed).
    """
    fused_names = []
    for parent_name, parent in list(model.named_modules()):
        for names in groups:
            members = [getattr(parent, n, None) for n in names]
            if any(m is None for m in members) or not _fusable(members):
                continue
            first = members[0]
            sizes = tuple(m.out_features for m in members)
            if isinstance(first, Fp8Linear):
                linear = Fp8Linear.concat(members)
            else:
                linear = nn.Linear(first.in_features, sum(sizes), bias=first.bias is not None,
                                   device="meta", dtype=first.weight.dtype)
                linear.weight = nn.Parameter(torch.cat([m.weight for m in members]), requires_grad=False)
                if first.bias is not None:
                    linear.bias = nn.Parameter(torch.cat([m.bias for m in members]), requires_grad=False)
            prefix = f"{parent_name}." if parent_name else ""
            linear.loramux_slices = tuple((prefix + n, size) for n, size in zip(names, sizes))
            if hasattr(first, "loramux_tp"):  # tensor-parallel shards: each slice holds this rank's rows
                linear.loramux_tp = first.loramux_tp
            group = FusedSiblings(linear, sizes)
            for index, name in enumerate(names):
                setattr(parent, name, SiblingSlice(group, index))
            del members, first
            release_cached(linear.weight.device)  # the members' weights, freed: see `release_cached`
            fused_names.append(f"{prefix}{names[0]}.siblings.fused")
    return fused_names
