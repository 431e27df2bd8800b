"""Reading an adapter's weights file once: into one host buffer, hashed and checked while it is read.

The file is read whole into a buffer the caller allocates (page-locked when a GPU is present, so
the copy into a GPU slot can run asynchronously straight from it), after asking the kernel to read
all of it ahead (``POSIX_FADV_WILLNEED``): the disk then streams the file while this thread parses
the header and builds the tensors' views. Each 1 MiB chunk is hashed on a small thread pool as
soon as it lands, while the next is read (hashlib, numpy and file reads release the GIL), and in a
safetensors file also scanned for NaN and infinity in its float tensors, so the content digest and
the finite check cost little beyond the read. Reads are `READ_BYTES` because each read and each
job takes the GIL back when it ends, and beside a busy engine thread that can wait up to a switch
interval: fewer, larger reads wait fewer times. The last `READ_BYTES` are read a chunk at a time,
and the last chunk `TAIL_PIECE_BYTES` at a time, hashed and scanned by the reading thread as each
piece lands, so that what is left after the last read is one piece's hash: SHA-256 runs slower
than a disk streams (cold loads stage by stage: docs/benchmarks/cold_load.md). A safetensors file
then becomes tensors that are views into that buffer: one copy from the disk, none after it.

safetensors' own Python API cannot do this: ``load_file`` copies every tensor out of a memory
map, ``load(bytes)`` copies twice, and neither builds tensors over a buffer we own. The format is
small and fixed (an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the data), and every offset is checked here
against the file before a tensor is made.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "HASH_CHUNK_BYTES", "SafetensorsLayout", "SafetensorsRead", "advise_read", "all_finite", "parse_safetensors",
    "read_and_hash", "read_layout", "read_pickle", "read_safetensors", "spans_finite",
]

#: Bytes of one hash job (and, in a safetensors file, of one finite scan).
HASH_CHUNK_BYTES = 1 << 20
#: Bytes of one read (but over the last of them: one chunk).
READ_BYTES = 4 * HASH_CHUNK_BYTES
#: Bytes of one read of a file's last chunk, which the reading thread hashes and scans as it lands.
TAIL_PIECE_BYTES = HASH_CHUNK_BYTES // 4

# safetensors dtype names (https://github.com/huggingface/safetensors#format) -> torch
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = max(2, min(8, os.cpu_count() or 2))
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="loramux-hash")
        return _pool


def advise_read(*paths: Path) -> None:
    """Ask the kernel to read ``paths`` ahead now, in this order (a hint: nothing waits, errors
    are ignored), so that their disk reads run back to back while the first is being used."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            _advise(fd)
        finally:
            os.close(fd)


def _advise(fd: int) -> None:
    """``POSIX_FADV_WILLNEED`` on the whole file, where the platform and the filesystem take it."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


class _FloatRun(NamedTuple):
    """Neighbouring tensors of one float dtype, as the integers the finite scan masks: file
    offsets ``begin``..``end``, elements of ``bits`` (numpy) whose exponent bits are ``mask``."""

    bits: np.dtype
    mask: int
    begin: int
    end: int


def _hash_and_scan(piece: list[memoryview], begin: int, end: int, runs: Sequence[_FloatRun]) -> tuple[bytes, bool]:
    """The SHA-256 of bytes ``begin``..``end`` of the file's view (the one item of ``piece``), and
    whether the float elements of ``runs`` there are finite (`_finite_in`).

    The view is taken out first: the pool's work item keeps its arguments until after the result
    is set, and a view kept there would hold the read buffer (an arena piece) past the moment
    its digest is known."""
    view = piece.pop()
    return hashlib.sha256(view[begin:end]).digest(), _finite_in(view, begin, end, runs)


def _finite_in(view: memoryview, begin: int, end: int, runs: Sequence[_FloatRun]) -> bool:
    """Whether the float elements of ``runs`` whose last byte lies in ``begin``..``end`` of the
    file's view are finite (an element that straddles two ranges is the later one's: its bytes
    before ``begin`` were read already)."""
    for run in runs:
        size = run.bits.itemsize
        first = max(0, -(-(begin - run.begin + 1) // size) - 1)
        last = min(run.end - run.begin, end - run.begin) // size
        if last > first and not _bits_finite(
                np.frombuffer(view, run.bits, last - first, run.begin + first * size), run.mask):
            return False
    return True


def _read(path: Path, allocate: Callable[[int], torch.Tensor],
          runs_after: Callable[[torch.Tensor, int], Sequence[_FloatRun] | None]) -> tuple[torch.Tensor, list[Future]]:
    """Read ``path`` whole into ``allocate(size)`` (a uint8 tensor), a `_hash_and_scan` job for
    each 1 MiB chunk as it lands but the last, which this thread hashes and scans a piece at a
    time as it lands (`_read_last_chunk`). ``runs_after(buffer, bytes read)`` says what the jobs
    scan, or None while it cannot say yet (a header still being read): chunks wait until it can.

    No closure here holds the buffer: a failed read's error keeps its frames, and their
    functions' closures, alive (`release_frames` clears the frames' locals, not closures)."""
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        buffer = allocate(size)
        view = memoryview(buffer.numpy())
        _advise(file.fileno())
        jobs: list[Future[tuple[bytes, bool]]] = []
        handed = start = 0  # bytes given to jobs; where the next read starts
        last = (size - 1) // HASH_CHUNK_BYTES * HASH_CHUNK_BYTES if size else 0  # where the last chunk starts
        try:
            while start < last:
                # the last READ_BYTES chunk by chunk: each chunk's job starts as it lands, so that
                # they end with the last chunk's own hash
                end = min(start + (READ_BYTES if last - start > READ_BYTES else HASH_CHUNK_BYTES), last)
                _read_into(file, view, start, end, path)
                start = end
                runs = runs_after(buffer, end)
                if runs is not None:
                    handed = _hand_out(jobs, view, handed, end, runs)
            if size:
                jobs.append(_read_last_chunk(file, buffer, view, last, path, runs_after, jobs, handed))
            else:  # an empty file: a header must still be there
                runs_after(buffer, 0)
        except BaseException:
            wait(jobs)  # they read the buffer: a failed read lets it go only once they are done
            raise
    return buffer, jobs


def _hand_out(jobs: list[Future[tuple[bytes, bool]]], view: memoryview, begin: int, end: int,
              runs: Sequence[_FloatRun]) -> int:
    """A `_hash_and_scan` job for each chunk of bytes ``begin``..``end`` (chunk-aligned at
    ``begin``), onto ``jobs``; returns ``end``."""
    pool = _hash_pool()
    for at in range(begin, end, HASH_CHUNK_BYTES):
        jobs.append(pool.submit(_hash_and_scan, [view], at, min(at + HASH_CHUNK_BYTES, end), runs))
    return end


def _read_into(file: io.RawIOBase, view: memoryview, begin: int, end: int, path: Path) -> None:
    """Bytes ``begin``..``end`` of ``file`` into ``view`` (a read may return fewer)."""
    while begin < end:
        read = file.readinto(view[begin:end])
        if not read:
            raise OSError(f"{path} shrank while being read ({begin} of {len(view)} bytes)")
        begin += read


def _read_last_chunk(file: io.RawIOBase, buffer: torch.Tensor, view: memoryview, begin: int, path: Path,
                     runs_after: Callable[[torch.Tensor, int], Sequence[_FloatRun] | None],
                     jobs: list[Future[tuple[bytes, bool]]], handed: int) -> Future[tuple[bytes, bool]]:
    """Read the file's last chunk (from ``begin``) `TAIL_PIECE_BYTES` at a time, hashing and
    scanning each piece here as it lands: what is left after the last read is one piece's hash,
    not a chunk's. The chunks before it from ``handed`` (read while the header was) get their
    jobs once ``runs_after`` can say what they scan. Returns its `_hash_and_scan` result, as a job's."""
    digest, finite, scanned, runs = hashlib.sha256(), True, begin, None
    for at in range(begin, len(view), TAIL_PIECE_BYTES):
        end = min(at + TAIL_PIECE_BYTES, len(view))
        _read_into(file, view, at, end, path)
        digest.update(view[at:end])
        if runs is None and (runs := runs_after(buffer, end)) is not None:
            _hand_out(jobs, view, handed, begin, runs)
        if runs is not None and finite:
            finite, scanned = _finite_in(view, scanned, end, runs), end
    result: Future[tuple[bytes, bool]] = Future()
    result.set_result((digest.digest(), finite))
    return result


def _digest(jobs: list[Future[tuple[bytes, bool]]]) -> Callable[[], bytes]:
    """The file's digest, once its jobs are done: SHA-256 over the SHA-256 of each 1 MiB chunk in
    order (a function of the bytes alone, whatever the reads return)."""
    return lambda: hashlib.sha256(b"".join(job.result()[0] for job in jobs)).digest()


def read_and_hash(
    path: Path, allocate: Callable[[int], torch.Tensor]
) -> tuple[torch.Tensor, Callable[[], bytes]]:
    """Read ``path`` whole into ``allocate(size)`` (a uint8 tensor) and hash it on the way.

    :returns: the buffer, and a function returning the file's digest: SHA-256 over the SHA-256
        of each 1 MiB chunk in order (a function of the bytes alone, whatever the reads return).
        The last chunks may still be hashing when this returns; call the function when the
        digest is needed, so parsing and checking the weights overlap the hash's tail. The hash
        threads hold the buffer until they are done: call it too before giving up on the buffer,
        so that it is freed at once.
    :raises OSError: the file cannot be read, or it shrank while being read.
    """
    buffer, jobs = _read(path, allocate, lambda buffer, read: ())
    return buffer, _digest(jobs)


class SafetensorsRead(NamedTuple):
    """A safetensors file read whole (`read_safetensors`)."""

    buffer: torch.Tensor
    layout: "SafetensorsLayout"
    #: the file's tensors, views into ``buffer``
    tensors: dict[str, torch.Tensor]
    #: the file's digest, as `read_and_hash` returns it (call it before giving up on the buffer)
    digest: Callable[[], bytes]
    #: whether every element of the file's float tensors is finite (when not, the tensors a caller
    #: keeps may still be: check those)
    finite: Callable[[], bool]


def read_safetensors(path: Path, allocate: Callable[[int], torch.Tensor]) -> SafetensorsRead:
    """`read_and_hash` for a safetensors file: its header is parsed (`read_layout`) and its tensors'
    views are built as soon as the header is read, while the disk reads the rest, and each chunk is
    scanned for NaN and infinity beside its hash.

    :raises OSError: the file cannot be read, or it shrank while being read.
    :raises ValueError: the header is truncated, not JSON, or names a dtype, shape or offsets
        that the file does not hold.
    """
    parsed: list = []

    def runs_after(buffer: torch.Tensor, read: int) -> Sequence[_FloatRun] | None:
        if not parsed:
            layout = _layout_of(memoryview(buffer.numpy()), read, buffer.numel())
            if layout is None:
                return None
            parsed.append(layout)
            if layout.views_only(buffer):  # views need no data: made while the disk reads the rest
                parsed.append(layout.tensors(buffer))
        return parsed[0].float_runs

    buffer, jobs = _read(path, allocate, runs_after)
    layout = parsed[0]
    try:
        tensors = parsed[1] if len(parsed) > 1 else layout.tensors(buffer)  # a copy needs the data
    except BaseException:
        wait(jobs)
        raise
    return SafetensorsRead(buffer, layout, tensors, _digest(jobs), lambda: all(job.result()[1] for job in jobs))


class _Entry(NamedTuple):
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # contiguous
    begin: int  # byte offsets in the data section
    end: int


@dataclass(frozen=True, eq=False)
class SafetensorsLayout:
    """A safetensors header, parsed and checked: each tensor's dtype, shape and place.

    Adapters of one kind (rank, targets, dtype) saved by one tool have byte-identical headers, so
    a layout is parsed once and kept (`read_layout`): a load of 448 tensors then skips the JSON
    and the per-tensor checks, and whatever is derived from the layout (the loader's module plan)
    can be kept with it. Identity is equality: one object per distinct header.
    """

    data_start: int  # the data section's offset in the file: 8 + the header's length
    entries: tuple[_Entry, ...]
    data_end: int  # the largest end offset: the file must hold this many data bytes
    derived: dict = field(default_factory=dict, repr=False)  # users' caches keyed by what they derive from

    @functools.cached_property
    def float_runs(self) -> tuple[_FloatRun, ...]:
        """The runs of float tensors as the finite scan masks them (every float dtype of the
        format has a mask): what `read_safetensors` scans for NaN and infinity."""
        return tuple(_FloatRun(np.dtype(_NUMPY_INTS[_EXPONENT_MASKS[dtype][0]]), _EXPONENT_MASKS[dtype][1], begin, end)
                     for dtype, begin, end in self.runs() if dtype.is_floating_point)

    def runs(self, keys: Collection[str] | None = None) -> tuple[tuple[torch.dtype, int, int], ...]:
        """``(dtype, begin, end)``: the byte runs (offsets in the file) of the tensors named ``keys``
        (default: all), neighbours of one dtype merged (a whole adapter file is usually one run)."""
        runs: list[list] = []
        for entry in sorted(self.entries, key=lambda e: e.begin):
            if (keys is not None and entry.key not in keys) or entry.end == entry.begin:
                continue
            begin, end = self.data_start + entry.begin, self.data_start + entry.end
            if runs and runs[-1][0] == entry.dtype and runs[-1][2] == begin:
                runs[-1][2] = end
            else:
                runs.append([entry.dtype, begin, end])
        return tuple((dtype, begin, end) for dtype, begin, end in runs)

    def views_only(self, buffer: torch.Tensor) -> bool:
        """Whether `tensors` of ``buffer`` are all views (no tensor is misaligned there, so none is
        copied): then they can be made before the data is read."""
        base = buffer.storage_offset() + self.data_start
        return all((base + entry.begin) % entry.dtype.itemsize == 0 for entry in self.entries)

    def tensors(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of a file with this header held in ``buffer`` (uint8), as views into it
        (a misaligned one, which safetensors never writes, as a copy).

        :raises ValueError: the file is too short for its header.
        """
        data_len = buffer.numel() - self.data_start
        if self.data_end > data_len:
            raise ValueError(f"the header places tensors up to byte {self.data_end} of the data, but the "
                             f"file has {max(data_len, 0)} data bytes")
        storage = buffer.untyped_storage()
        base = buffer.storage_offset() + self.data_start  # bytes from the storage's start
        typed: dict[torch.dtype, torch.Tensor] = {}  # the whole storage seen as each dtype
        tensors: dict[str, torch.Tensor] = {}
        for key, dtype, shape, stride, begin, end in self.entries:
            start = base + begin
            if start % dtype.itemsize:  # never written so by safetensors; still legal
                tensors[key] = buffer[self.data_start + begin : self.data_start + end].clone().view(dtype).view(shape)
                continue
            flat = typed.get(dtype)
            if flat is None:
                flat = typed[dtype] = torch.empty(0, dtype=dtype).set_(storage)
            tensors[key] = flat.as_strided(shape, stride, start // dtype.itemsize)  # one op a tensor
        return tensors


_LAYOUTS_KEPT = 64
_layouts: OrderedDict[bytes, SafetensorsLayout] = OrderedDict()  # by header bytes, most recent last
_layouts_lock = threading.Lock()


def read_layout(buffer: torch.Tensor) -> SafetensorsLayout:
    """The layout of the safetensors file held in ``buffer`` (uint8): parsed and checked once per
    distinct header (the last `_LAYOUTS_KEPT` are kept).

    :raises ValueError: the header is truncated, not JSON, or names a dtype, shape or offsets
        that are not a tensor's.
    """
    return _layout_of(memoryview(buffer.numpy()), buffer.numel(), buffer.numel())


def _layout_of(raw: memoryview, have: int, size: int) -> SafetensorsLayout | None:
    """`read_layout` of a file of ``size`` bytes whose first ``have`` are in ``raw``; None while its
    header is not all there."""
    if size < 8:
        raise ValueError(f"the file has {size} bytes, fewer than its 8-byte header length")
    if have < 8:
        return None
    header_len = int.from_bytes(raw[:8], "little")
    if header_len > size - 8:
        raise ValueError(f"the header claims {header_len} bytes but the file has {size - 8} after it")
    if have < 8 + header_len:
        return None
    header_bytes = bytes(raw[8 : 8 + header_len])
    with _layouts_lock:
        layout = _layouts.get(header_bytes)
        if layout is not None:
            _layouts.move_to_end(header_bytes)
            return layout
    layout = _parse_header(header_bytes)
    with _layouts_lock:
        _layouts[header_bytes] = layout
        while len(_layouts) > _LAYOUTS_KEPT:
            _layouts.popitem(last=False)
    return layout


def _parse_header(header_bytes: bytes) -> SafetensorsLayout:
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"the header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(dim) for dim in info["shape"])
            begin, end = (int(offset) for offset in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {key!r} has a malformed header entry {info!r}") from None
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {key!r}: offsets {begin}..{end} do not hold {dtype} {list(shape)}")
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        entries.append(_Entry(key, dtype, shape, stride, begin, end))
    return SafetensorsLayout(8 + len(header_bytes), tuple(entries), max((e.end for e in entries), default=0))


def parse_safetensors(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``buffer`` (uint8), as views into it.

    :raises ValueError: the header is truncated, not JSON, or names a dtype, shape or offsets
        that the file does not hold.
    """
    return read_layout(buffer).tensors(buffer)


def read_pickle(buffer: torch.Tensor) -> object:
    """``torch.load(weights_only=True)`` of a pickled weights file held in ``buffer``: nothing
    in the pickle can run code."""
    return torch.load(io.BytesIO(memoryview(buffer.numpy())), map_location="cpu", weights_only=True)


# Bits all set only in infinity or NaN (the exponent's; float8_e4m3fn has no infinity, and its
# only NaN sets every bit but the sign), so one integer AND finds both without a float op
# (isfinite on bfloat16 runs ~30x slower on CPU than this, and torch has none for float8).
_EXPONENT_MASKS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
    torch.float8_e4m3fn: (torch.int8, 0x7F),
    torch.float8_e5m2: (torch.int8, 0x7C),
}
_NUMPY_INTS = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
_CHECK_ELEMENTS = 1 << 18  # per step: the scratch buffer stays in cache


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every (floating point) tensor is finite.

    Tensors that lie back to back in one storage (the views of one safetensors file) are checked
    as one span, so a file of 128 tensors costs a few large operations, not 128 small ones.
    """
    return all(_span_finite(span) for span in _spans(tensors))


def spans_finite(buffer: torch.Tensor, spans: Sequence[tuple[torch.dtype, int, int]]) -> bool:
    """Whether every element in the byte ranges ``spans`` of ``buffer`` (uint8) is finite, each
    ``(dtype, begin, end)`` a run of elements of ``dtype`` (the loader derives them once per
    layout: no per-tensor work)."""
    for dtype, begin, end in spans:
        span = buffer[begin:end]
        if span.storage_offset() % dtype.itemsize:  # a misaligned file: legal, never written so
            span = span.clone()
        if not _span_finite(span.view(dtype)):
            return False
    return True


def _span_finite(span: torch.Tensor) -> bool:
    mask = _EXPONENT_MASKS.get(span.dtype)
    if mask is None:
        return bool(torch.isfinite(span).all())
    return _bits_finite(span.view(mask[0]).numpy(), mask[1])


def _bits_finite(bits: np.ndarray, mask: int) -> bool:
    """Whether no element of ``bits`` (a float array seen as integers) has all of its exponent
    bits ``mask`` set: no NaN or infinity."""
    # numpy, not torch: one thread, SIMD, no intra-op thread pool to wake (which, on a busy
    # host, made this check 10-100x slower); max, not any(): an int reduction is vectorized
    scratch = np.empty(min(bits.size, _CHECK_ELEMENTS), dtype=bits.dtype)
    for start in range(0, bits.size, _CHECK_ELEMENTS):
        chunk = bits[start : start + _CHECK_ELEMENTS]
        masked = np.bitwise_and(chunk, mask, out=scratch[: chunk.size])
        if int(masked.max()) == mask:
            return False
    return True


def _spans(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Flat views covering ``tensors``: neighbours in one storage with one dtype are merged
    (ranges are merged first and one view is made per span: a view per tensor costs more than
    the check itself on a file of many small tensors)."""
    ranges: list[list] = []  # [first tensor, storage pointer, dtype, start, end] in elements
    for tensor in sorted(
        (t for t in tensors if t.is_contiguous() and t.numel()),
        key=lambda t: (t.untyped_storage().data_ptr(), t.storage_offset()),
    ):
        pointer, start = tensor.untyped_storage().data_ptr(), tensor.storage_offset()
        last = ranges[-1] if ranges else None
        if last is not None and last[1] == pointer and last[2] == tensor.dtype and last[4] == start:
            last[4] = start + tensor.numel()
        else:
            ranges.append([tensor, pointer, tensor.dtype, start, start + tensor.numel()])
    spans = [
        first.new_empty(0).set_(first.untyped_storage(), start, (end - start,))
        for first, _, _, start, end in ranges
    ]
    spans.extend(t.contiguous().reshape(-1) for t in tensors if not t.is_contiguous())  # rare: a copy
    return spans
