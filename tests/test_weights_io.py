"""Reading weights once: safetensors parsed into views of the read buffer (checked like the library
checks them), the chunked digest, and the finite check on every float dtype."""

from __future__ import annotations

import hashlib
import json
import struct
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.registry.weights_io import HASH_CHUNK_BYTES, READ_BYTES, all_finite, parse_safetensors, read_and_hash

ALLOCATE = partial(torch.empty, dtype=torch.uint8)


def read(path) -> torch.Tensor:
    return read_and_hash(path, ALLOCATE)[0]


def test_tensors_match_the_library_and_are_views_of_the_buffer(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7, 2).bfloat16(),
        "f16": torch.randn(4).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    buffer = read(path)
    parsed = parse_safetensors(buffer)
    expected = load_file(path)
    assert parsed.keys() == expected.keys()
    for key, tensor in expected.items():
        assert parsed[key].dtype == tensor.dtype and torch.equal(parsed[key], tensor)
    storage = buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in parsed.values())  # no copy


@pytest.mark.parametrize("size", [2 * HASH_CHUNK_BYTES + 123, 2 * READ_BYTES + HASH_CHUNK_BYTES + 5, READ_BYTES])
def test_the_digest_is_independent_of_how_reads_return(tmp_path, size):
    """Within one read, across several (each hashed as one job), a whole number of reads: the
    digest is the tree hash of the file's 1 MiB chunks."""
    data = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    buffer, digest = read_and_hash(path, ALLOCATE)
    digest = digest()
    chunks = [data[i : i + HASH_CHUNK_BYTES] for i in range(0, len(data), HASH_CHUNK_BYTES)]
    assert len(chunks) == -(-size // HASH_CHUNK_BYTES) and bytes(buffer.numpy()) == data
    assert digest == hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in chunks)).digest()


def raw_file(header: dict | bytes, data: bytes = b"", claimed: int | None = None) -> torch.Tensor:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw = struct.pack("<Q", len(body) if claimed is None else claimed) + body + data
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@pytest.mark.parametrize(
    "buffer, message",
    [
        (torch.zeros(5, dtype=torch.uint8), "fewer than its 8-byte header length"),
        (raw_file({}, claimed=10_000), "the header claims 10000 bytes"),
        (raw_file(b"{not json"), "the header is not JSON"),
        (raw_file(b"[1, 2]"), "not a JSON object"),
        (raw_file({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "malformed"),
        (raw_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
         "the file has 4 data bytes"),
        (raw_file({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "do not hold"),
        (raw_file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "do not hold"),
        (raw_file({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "malformed"),
    ],
    ids=["short", "header-too-long", "not-json", "not-object", "dtype", "outside", "size", "negative",
         "no-offsets"],
)
def test_a_malformed_file_is_refused_with_what_is_wrong(buffer, message):
    with pytest.raises(ValueError, match=message):
        parse_safetensors(buffer)


def test_a_misaligned_tensor_is_copied_not_refused():
    data = b"\0" + struct.pack("<f", 1.5)
    header = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}, "pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    body = json.dumps(header).encode()
    body += b" " * (-(8 + len(body)) % 8)  # the data starts 8-aligned, so "w" is at an odd offset
    buffer = torch.frombuffer(bytearray(struct.pack("<Q", len(body)) + body + data), dtype=torch.uint8)
    assert parse_safetensors(buffer)["w"].tolist() == [1.5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_finds_nan_and_infinity_in_every_float_dtype(dtype, bad):
    big = torch.randn((1 << 20) + 5).to(dtype)  # spans more than one check step
    assert all_finite([big])
    big[-1] = bad  # in the last, partial step
    assert not all_finite([big])
    assert all_finite([torch.tensor([-0.0, 65504.0 if dtype == torch.float16 else 1e30]).to(dtype)])


def test_all_finite_checks_neighbouring_views_as_one_span_and_stray_tensors_alone():
    storage = torch.randn(100)
    views = [storage[:40].view(4, 10), storage[40:100]]
    assert all_finite(views)
    storage[70] = float("nan")
    assert not all_finite(views)
    strided = torch.randn(4, 6)[:, ::2]
    assert all_finite([strided, torch.zeros(0)])
    strided[1, 1] = float("inf")
    assert not all_finite([strided])
