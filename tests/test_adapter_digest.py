"""The content digest: a function of the weights and the scaling-relevant config only, computed
from the one read of the files."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from loramux.registry import LoRAConfig, load_adapter_with_digest
from loramux.registry import weights_io
from loramux.registry.handle import combine_digest, config_digest


@pytest.fixture
def adapter(tmp_path, make_adapter):
    source = make_adapter("digested", target_modules=["q_proj", "v_proj", "down_proj"])
    copy = tmp_path / "adapter"
    shutil.copytree(source, copy)
    return copy


def digest_of(directory, config=None) -> str:
    return load_adapter_with_digest(directory, config)[1]


def edit_config(directory, **changes) -> None:
    config_file = directory / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("which", ["first", "middle", "last"])
@pytest.mark.parametrize("element", [(0, 0), (-1, -1)])
def test_changing_any_single_weight_changes_the_digest(adapter, which, element):
    before = digest_of(adapter)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    keys = sorted(tensors)
    key = {"first": keys[0], "middle": keys[len(keys) // 2], "last": keys[-1]}[which]
    tensors[key][element] = tensors[key][element] * 1.0001 + 1e-6  # the smallest kind of change
    save_file(tensors, weights, metadata={"format": "pt"})
    assert digest_of(adapter) != before


@pytest.mark.parametrize(
    "changes",
    [
        dict(lora_alpha=17),
        dict(use_rslora=True),
        dict(alpha_pattern={"v_proj": 3}),
        dict(target_modules=["q_proj", "v_proj", "down_proj", "up_proj"]),
    ],
    ids=["alpha", "rslora", "alpha-pattern", "targets"],
)
def test_changing_the_scaling_config_changes_the_digest(adapter, changes):
    before = digest_of(adapter)
    edit_config(adapter, **changes)
    assert digest_of(adapter) != before


def test_the_digest_names_content_not_place_or_name(adapter, tmp_path):
    before = digest_of(adapter)
    elsewhere = tmp_path / "somewhere" / "else"
    shutil.copytree(adapter, elsewhere)
    assert load_adapter_with_digest(elsewhere, name="renamed")[1] == before
    # fields that do not change what the weights compute, and PEFT's explicit defaults
    edit_config(elsewhere, peft_version="9.9.9", base_model_name_or_path="/models/x",
                rank_pattern={}, use_rslora=False, inference_mode=False)
    assert digest_of(elsewhere) == before


def test_the_digest_follows_the_dtype_the_weights_are_kept_in(adapter):
    assert digest_of(adapter, LoRAConfig(lora_dtype="float16")) != digest_of(adapter)


def test_the_digest_is_the_documented_tree_hash_of_the_bytes_read(adapter):
    data = (adapter / "adapter_model.safetensors").read_bytes()
    chunks = [data[i : i + weights_io.HASH_CHUNK_BYTES] for i in range(0, len(data), weights_io.HASH_CHUNK_BYTES)]
    weights = hashlib.sha256(b"".join(hashlib.sha256(chunk).digest() for chunk in chunks)).digest()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert digest_of(adapter) == combine_digest(config_digest(config, None), weights)


def test_the_weights_file_is_read_once_for_tensors_and_digest(adapter, monkeypatch):
    opened = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(weights_io, "open", counting_open, raising=False)
    monkeypatch.setattr("safetensors.torch.load_file", lambda *a, **k: pytest.fail("read twice"))
    load_adapter_with_digest(adapter)
    assert opened == [str(adapter / "adapter_model.safetensors")]
