"""Reading weights once: safetensors parsed into views of the read buffer (checked like the library
checks them), the chunked digest, the finite check on every float dtype, and the finite scan run
chunk by chunk while a file is read."""

from __future__ import annotations

import hashlib
import json
import struct
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.registry.weights_io import (
    HASH_CHUNK_BYTES,
    READ_BYTES,
    TAIL_PIECE_BYTES,
    all_finite,
    parse_safetensors,
    read_and_hash,
    read_safetensors,
)

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


@pytest.mark.parametrize("buffer, message", [
    (torch.zeros(5, dtype=torch.uint8), "fewer than its 8-byte header length"),
    (torch.zeros(0, dtype=torch.uint8), "fewer than its 8-byte header length"),
    (raw_file({}, claimed=10_000), "the header claims 10000 bytes"),
    (raw_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "the file has 4 data bytes"),
], ids=["short", "empty", "header-too-long", "outside"])
def test_reading_a_malformed_file_is_refused_with_what_is_wrong(tmp_path, buffer, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(bytes(buffer.numpy()))
    with pytest.raises(ValueError, match=message):
        read_safetensors(path, ALLOCATE)


def mixed_file(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float tensors of every masked dtype and an integer one, over more than two reads."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "a.bf16": torch.randn(3 * READ_BYTES // 4, generator=generator).bfloat16(),  # across chunks and reads
        "b.i64": torch.arange(100),
        "c.f16": torch.randn(1000, generator=generator).half(),
        "d.f32": torch.randn(HASH_CHUNK_BYTES // 4 + 3, generator=generator),
        "e.f64": torch.randn(77, generator=generator).double(),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return tensors


def test_read_safetensors_gives_the_tensors_and_the_digest_of_a_plain_read(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = mixed_file(path)
    read = read_safetensors(path, ALLOCATE)
    assert read.finite()
    assert read.tensors.keys() == tensors.keys()
    assert all(torch.equal(read.tensors[k], t) for k, t in tensors.items())
    assert read.digest() == read_and_hash(path, ALLOCATE)[1]()


def float_offsets(path, key: str) -> list[int]:
    """File offsets of the first element of ``key``, of its last, and of those that start just
    before and at each chunk boundary inside it, and each boundary of the pieces the last chunk
    is read in."""
    buffer = read(path)
    tensor = parse_safetensors(buffer)[key]
    start = tensor.data_ptr() - buffer.data_ptr()
    end = start + tensor.nbytes
    size = tensor.element_size()
    last = (buffer.numel() - 1) // HASH_CHUNK_BYTES * HASH_CHUNK_BYTES
    bounds = [*range(HASH_CHUNK_BYTES, last + 1, HASH_CHUNK_BYTES),
              *range(last + TAIL_PIECE_BYTES, end, TAIL_PIECE_BYTES)]
    near = [b + d for b in bounds if start < b < end for d in (-size, 0)]
    return [start, end - size, *near]


@pytest.mark.parametrize("key", ["a.bf16", "c.f16", "d.f32", "e.f64"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_scan_finds_a_non_finite_element_wherever_it_lies(tmp_path, key, bad):
    """First and last element, and the elements on both sides of every chunk boundary: the scan
    of each chunk covers exactly the elements that end in it."""
    clean = tmp_path / "clean.safetensors"
    tensors = mixed_file(clean)
    dtype = tensors[key].dtype
    for offset in float_offsets(clean, key):
        data = bytearray(clean.read_bytes())
        data[offset : offset + dtype.itemsize] = torch.tensor([bad], dtype=dtype).view(torch.uint8).numpy().tobytes()
        path = tmp_path / f"bad-{offset}.safetensors"
        path.write_bytes(bytes(data))
        read = read_safetensors(path, ALLOCATE)
        assert not read.finite(), offset
        assert not all_finite([read.tensors[key]])  # the exact check agrees
        assert all(all_finite([t]) for k, t in read.tensors.items() if k != key)


def test_an_element_straddling_two_chunks_is_scanned(tmp_path):
    """A misaligned float tensor (legal, never written so by safetensors) has elements across a
    chunk boundary: the one across it is found, and the tensor is a copy, not a view."""
    count = HASH_CHUNK_BYTES // 2 + 10
    header = {"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "w": {"dtype": "BF16", "shape": [count], "data_offsets": [1, 1 + 2 * count]}}
    body = json.dumps(header).encode()
    body += b" " * (-(8 + len(body)) % 8)
    data_start = 8 + len(body)
    values = torch.zeros(count, dtype=torch.bfloat16)
    k = (HASH_CHUNK_BYTES - data_start - 1) // 2  # the element whose bytes lie on both sides of 1 MiB
    assert data_start + 1 + 2 * k == HASH_CHUNK_BYTES - 1
    values[k] = float("nan")
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" + values.view(torch.uint8).numpy().tobytes())
    read = read_safetensors(path, ALLOCATE)
    assert not read.finite()
    assert read.tensors["w"][k].isnan() and read.tensors["w"].untyped_storage().data_ptr() != read.buffer.data_ptr()
    values[k] = 1.0
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" + values.view(torch.uint8).numpy().tobytes())
    assert read_safetensors(path, ALLOCATE).finite()


def test_a_header_longer_than_a_read_delays_the_scan_not_the_answer(tmp_path):
    """The chunks read before the header ends are scanned once it is parsed."""
    path = tmp_path / "long-header.safetensors"
    tensors = {"w": torch.randn(HASH_CHUNK_BYTES).bfloat16()}
    tensors["w"][-1] = float("inf")
    save_file(tensors, path, metadata={"note": "x" * (READ_BYTES + 12345)})
    read = read_safetensors(path, ALLOCATE)
    assert not read.finite() and torch.equal(read.tensors["w"], tensors["w"])
    assert read.digest() == read_and_hash(path, ALLOCATE)[1]()


@pytest.mark.parametrize("note", [300_000, 1_400_000], ids=["all-in-the-last-chunk", "ends-in-the-last-chunk"])
@pytest.mark.parametrize("where", [0, -1])
def test_a_header_that_ends_in_the_last_chunk_is_scanned_and_hashed_in_order(tmp_path, note, where):
    """The last chunk is read in pieces: a header that ends past its first piece starts the scan
    there, the chunks before it are handed out then, and the digest is the plain read's."""
    path = tmp_path / "tail-header.safetensors"
    tensors = {"w": torch.randn(100_000).bfloat16()}
    save_file(tensors, path, metadata={"note": "x" * note})
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    assert header_end > (path.stat().st_size - 1) // HASH_CHUNK_BYTES * HASH_CHUNK_BYTES + TAIL_PIECE_BYTES
    clean = read_safetensors(path, ALLOCATE)
    assert clean.finite() and clean.digest() == read_and_hash(path, ALLOCATE)[1]()
    tensors["w"][where] = float("inf")
    save_file(tensors, path, metadata={"note": "x" * note})
    bad = read_safetensors(path, ALLOCATE)
    assert not bad.finite() and torch.equal(bad.tensors["w"], tensors["w"])
    assert bad.digest() == read_and_hash(path, ALLOCATE)[1]()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_is_scanned_and_checked_too(tmp_path, dtype):
    """float8_e4m3fn has no infinity and one NaN: its largest finite values are not taken for one."""
    path = tmp_path / "fp8.safetensors"
    largest = torch.tensor([448.0 if dtype == torch.float8_e4m3fn else 57344.0, -1.5, 0.0]).to(dtype)
    save_file({"w": largest, "v": torch.randn(4)}, path)
    read = read_safetensors(path, ALLOCATE)
    assert read.finite() and all_finite([read.tensors["w"]])
    bad = largest.clone()
    bad[1] = float("nan")
    save_file({"w": bad, "v": torch.randn(4)}, path)
    read = read_safetensors(path, ALLOCATE)
    assert not read.finite() and not all_finite([read.tensors["w"]])


def test_every_float_dtype_of_the_format_has_a_mask():
    from loramux.registry.weights_io import _DTYPES, _EXPONENT_MASKS

    assert {d for d in _DTYPES.values() if d.is_floating_point} <= _EXPONENT_MASKS.keys()


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
