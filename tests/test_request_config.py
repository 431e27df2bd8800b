"""LoRARequest and LoRAConfig: valid values pass, each invalid one names its field and the rule."""

import dataclasses
import os

import pytest
import torch

import loramux
from loramux import LoRAConfig, LoRARequest
from loramux.registry import default_cpu_lora_bytes


def test_request_is_immutable_and_equal_by_id():
    request = LoRARequest("sql", 1, "/adapters/sql")
    assert request == LoRARequest("renamed", 1, "/elsewhere")
    assert request != LoRARequest("sql", 2, "/adapters/sql")
    assert len({request, LoRARequest("other", 1)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.lora_name = "other"  # type: ignore[misc]
    assert request.base_model_name is None and LoRARequest("x", 3).lora_path == ""


@pytest.mark.parametrize("name", ["org/repo", "org/repo/sub-dir", "a_b.c-1", "ünïcode"])
def test_request_accepts_safe_names(name):
    assert LoRARequest(name, 1).lora_name == name


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        ("bad\nname", "control character"),
        ("bad\x00name", "control character"),
        ("..", "'..' path segments"),
        ("a/../b", "'..' path segments"),
        ("a\\..\\b", "'..' path segments"),
        ("./a", "'..' path segments"),
        ("/etc/passwd", "must be relative"),
        ("\\share", "must be relative"),
        ("C:evil", "must be relative"),
        ("x" * 300, "limit is 256"),
        (42, "must be a string"),
    ],
)
def test_request_rejects_unsafe_names(name, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(name, 1)


@pytest.mark.parametrize("bad_id", [0, -3, True, 1.0, "1", None])
def test_request_rejects_ids_that_are_not_positive_ints(bad_id):
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", bad_id)


def test_config_defaults():
    config = LoRAConfig()
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (None, 16, None)  # bytes bound the tiers
    assert config.lora_dtype == "auto" and config.torch_dtype is None
    assert LoRAConfig(max_loras=4).max_cpu_loras == 4
    assert LoRAConfig(max_lora_rank=512).max_lora_rank == 512
    assert LoRAConfig(lora_dtype=torch.bfloat16).torch_dtype is torch.bfloat16
    assert LoRAConfig(lora_dtype="float16").torch_dtype is torch.float16


def test_the_cpu_tier_has_a_byte_budget_by_default_from_host_memory():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert LoRAConfig().max_cpu_lora_bytes == default_cpu_lora_bytes() == int(total * 0.10)
    assert LoRAConfig(max_cpu_lora_bytes=123).max_cpu_lora_bytes == 123


def test_the_page_locked_arena_takes_the_cpu_tiers_budget_up_to_8_gib_by_default():
    assert LoRAConfig(max_cpu_lora_bytes=123).max_pinned_lora_bytes == 123
    assert LoRAConfig(max_cpu_lora_bytes=100 << 30).max_pinned_lora_bytes == 8 << 30
    assert LoRAConfig(max_cpu_lora_bytes=100 << 30, max_pinned_lora_bytes=0).max_pinned_lora_bytes == 0


def test_the_default_byte_budget_without_sysconf(monkeypatch):
    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(os, "sysconf", unknown)
    assert default_cpu_lora_bytes() == 4 << 30


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(max_loras=0), "max_loras", "an int >= 1"),
        (dict(max_loras=2.5), "max_loras", "an int >= 1"),
        (dict(max_lora_rank=0), "max_lora_rank", "from 1 to 512"),
        (dict(max_lora_rank=513), "max_lora_rank", "from 1 to 512"),
        (dict(max_lora_rank=True), "max_lora_rank", "from 1 to 512"),
        (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras", ">= max_loras"),
        (dict(lora_dtype="int8"), "lora_dtype", "float16"),
        (dict(lora_dtype=torch.int8), "lora_dtype", "torch.bfloat16"),
        (dict(max_cpu_lora_bytes=0), "max_cpu_lora_bytes", "an int >= 1"),
        (dict(max_cpu_lora_bytes=1.5e9), "max_cpu_lora_bytes", "an int >= 1"),
        (dict(max_pinned_lora_bytes=-1), "max_pinned_lora_bytes", "from 0 to max_cpu_lora_bytes"),
        (dict(max_cpu_lora_bytes=100, max_pinned_lora_bytes=101), "max_pinned_lora_bytes",
         "from 0 to max_cpu_lora_bytes (100)"),
    ],
)
def test_config_errors_name_field_value_and_rule(kwargs, field, allowed):
    with pytest.raises(ValueError) as excinfo:
        LoRAConfig(**kwargs)
    message = str(excinfo.value)
    assert f"LoRAConfig.{field}" in message and allowed in message
    assert repr(next(iter(kwargs.values()))) in message or "torch.int8" in message


def test_public_api_is_exported():
    for name in ("LoRARequest", "LoRAConfig", "LoRAError", "InvalidAdapterError"):
        assert name in loramux.__all__ and getattr(loramux, name)
    assert issubclass(loramux.AdapterNotFoundError, loramux.LoRAError)
    assert issubclass(loramux.IncompatibleAdapterError, loramux.LoRAError)
