"""`loramux.kernels.static_meta`: a static LoRA meta's device arrays in one Triton launch (the
default on CUDA, ``LORAMUX_META_KERNEL=0`` turns it off) equal the torch build's, for every kind of mapping (CPU interpreter and
`gpu`); bad settings are refused with the variable's name."""

from __future__ import annotations

import pytest
import torch

from conftest import needs_cuda, needs_interpreter, setenv
from loramux.kernels import build_lora_meta
from loramux.kernels.metadata import _slot_vector_pad, _static_arrays
from loramux.kernels.static_meta import ENV_VAR, static_meta_arrays, use_meta_kernel

NAMES = ("sorted_token_ids", "active_slots", "active_counts", "active_starts")


def mappings(T: int, S: int, seed: int) -> dict[str, torch.Tensor]:
    """Base rows only, one slot, every token its own slot, a random mix with slots out of range."""
    g = torch.Generator().manual_seed(seed)
    return {"base": torch.full((T,), -1), "one slot": torch.full((T,), S - 1), "own slots": torch.arange(T) % S,
            "mixed": torch.randint(-2, S + 2, (T,), generator=g)}


def assert_same_arrays(token_slots: torch.Tensor, S: int) -> None:
    pad = _slot_vector_pad(S)
    for name, ours, torchs in zip(NAMES, static_meta_arrays(token_slots, S, pad), _static_arrays(token_slots, S, pad)):
        assert ours.dtype == torch.int32 and torch.equal(ours.cpu(), torchs.cpu()), (name, token_slots.tolist()[:8])


@needs_interpreter
@pytest.mark.parametrize("T,S", [(0, 4), (1, 1), (5, 3), (16, 16), (64, 32), (64, 256), (300, 8), (17, 300)])
def test_one_launch_lays_the_meta_out_as_the_torch_ops_do(T, S):
    for token_slots in mappings(T, S, seed=T * 1000 + S).values():
        assert_same_arrays(token_slots.to(torch.int32), S)


@needs_interpreter
def test_a_static_meta_built_by_the_kernel_is_the_torch_built_one(monkeypatch):
    """Where it is used, `build_lora_meta(static=True)` takes its device arrays from the kernel; every
    field of the meta matches the torch build (here on the CPU, the kernel interpreted)."""
    from loramux.kernels import static_meta

    slots = mappings(64, 32, seed=3)["mixed"].to(torch.int32)
    by_torch = build_lora_meta(slots, 32, static=True)
    monkeypatch.setattr(static_meta, "use_meta_kernel", lambda device: True)
    by_kernel = build_lora_meta(slots, 32, static=True)
    for name in NAMES + ("token_slots",):
        assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), name
    assert by_kernel.active_counts_host == by_torch.active_counts_host and by_kernel.static


def test_the_setting_is_read_and_bad_values_are_refused(monkeypatch):
    for value, cuda, expected in (("", True, True), ("0", True, False), ("1", True, True), ("1", False, False)):
        setenv(monkeypatch, ENV_VAR, value)
        assert use_meta_kernel(torch.device("cuda" if cuda else "cpu")) is expected, (value, cuda)
    with pytest.raises(ValueError, match=f"{ENV_VAR}='yes' is not understood"):
        setenv(monkeypatch, ENV_VAR, "yes")
    setenv(monkeypatch, ENV_VAR, "0")
    assert build_lora_meta(torch.zeros(4, dtype=torch.int32), 2, static=True).static  # still builds


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T,S", [(1, 32), (64, 32), (64, 256), (512, 256), (4096, 256)])
def test_gpu_one_launch_lays_the_meta_out_as_the_torch_ops_do(T, S):
    for token_slots in mappings(T, S, seed=T + S).values():
        assert_same_arrays(token_slots.to(torch.int32).cuda(), S)
