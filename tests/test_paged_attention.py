"""Paged attention and the KV write: the Triton kernels against the torch reference, and
the reference against a dense causal attention computed from scratch (the independent oracle).

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py) in float32 and
float16, on tiny shapes; `gpu` tests run bfloat16 on Llama-3.1-8B shapes and a CUDA-graph replay.
Cache slots no sequence owns hold NaN, so a read of one that reaches a result fails the test.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loramux.kernels import attention_reference, paged_attention, write_kv

from conftest import INTERPRET, needs_cuda, needs_interpreter, rel_err, setenv


# ---------------------------------------------------------------------------------------------
# helpers


@dataclass(frozen=True)
class Case:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (seq_len after this step, query tokens this step) per sequence
    H: int = 4
    Hkv: int = 2
    D: int = 16
    block_size: int = 8
    sliding_window: int | None = None
    softcap: float | None = None

    def __str__(self):
        return self.name


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [L, Hkv, D]: what the cache holds, laid out densely
    values: list[torch.Tensor]

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc


def make_batch(case: Case, dtype=torch.float32, device="cpu", seed=0, spare_blocks=3) -> Batch:
    """Random q/K/V; each sequence's blocks are a random (non-contiguous, shuffled) subset of the
    cache, table entries past them are random valid ids, and unowned slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, D = case.block_size, case.Hkv, case.D
    need = [-(-L // bs) for L, _ in case.seqs]
    max_blocks = max(need + [1]) + 1
    num_blocks = sum(need) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(case.seqs), max_blocks), generator=gen)
    k_cache = torch.full((num_blocks, bs, hkv, D), float("nan"))
    v_cache = torch.full((num_blocks, bs, hkv, D), float("nan"))
    keys, values, used = [], [], 0
    for b, (L, _) in enumerate(case.seqs):
        tables[b, : need[b]] = ids[used : used + need[b]]
        used += need[b]
        k = torch.randn(L, hkv, D, generator=gen)
        v = torch.randn(L, hkv, D, generator=gen)
        pos = torch.arange(L)
        slots = tables[b, pos // bs] * bs + pos % bs
        attention_reference.write_kv_ref(k, v, k_cache, v_cache, slots)
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
    n_q = torch.tensor([n for _, n in case.seqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), n_q.cumsum(0)])
    q = torch.randn(int(qsl[-1]), case.H, D, generator=gen)
    to = dict(device=device)
    return Batch(q.to(dtype=dtype, **to), k_cache.to(dtype=dtype, **to), v_cache.to(dtype=dtype, **to),
                 tables.to(torch.int32).to(**to), torch.tensor([L for L, _ in case.seqs], dtype=torch.int32, **to),
                 qsl.to(torch.int32).to(**to), keys, values)


def dense_attention(batch: Batch, scale, sliding_window=None, softcap=None) -> torch.Tensor:
    """The oracle: per sequence and head, softmax(mask(q k^T)) v in float64 over the dense keys,
    written the obvious way (no cache, no block table, no grouped heads)."""
    q = batch.q.double().cpu()
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    qsl = batch.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        s, e = qsl[b], qsl[b + 1]
        L, hkv = k.shape[0], k.shape[1]
        if L == 0:
            continue
        for h in range(H):
            kh, vh = k[:, h // (H // hkv)].double(), v[:, h // (H // hkv)].double()  # [L, D]
            for i in range(e - s):
                pos = L - (e - s) + i
                scores = (kh[: pos + 1] @ q[s + i, h]) * scale  # keys 0..pos
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                if sliding_window is not None:
                    scores[: max(0, pos - sliding_window + 1)] = float("-inf")
                out[s + i, h] = torch.softmax(scores, 0) @ vh[: pos + 1]
    return out


def reference_of(batch: Batch, case: Case, scale: float) -> torch.Tensor:
    """The reference in float64 on the batch's own (rounded) values."""
    args = [t.double() if t.is_floating_point() else t for t in batch.args()]
    return attention_reference.paged_attention_ref(*args, scale=scale, sliding_window=case.sliding_window,
                                                   softcap=case.softcap)


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}

DECODES = ((1, 1), (7, 1), (8, 1), (9, 1), (25, 1))  # around block_size 8
CASES = [
    Case("block-boundaries", DECODES),
    Case("mixed", ((5, 1), (12, 12), (20, 6), (0, 1), (9, 1), (17, 3), (0, 1))),  # decodes, prefill, chunk, padding
    Case("gqa1", ((9, 1), (11, 4)), H=2, Hkv=2),
    Case("gqa4", ((9, 1), (11, 4), (3, 3)), H=4, Hkv=1, D=32),
    Case("gqa8-d64", ((17, 1), (6, 5)), H=8, Hkv=1, D=64),
    Case("d24", ((10, 2), (8, 1)), D=24),
    Case("d80-block16", ((33, 1), (16, 9)), H=2, Hkv=1, D=80, block_size=16),
    Case("window", ((30, 1), (26, 7), (4, 4)), sliding_window=5),
    Case("softcap", ((14, 1), (11, 6)), softcap=1.5),
    Case("window-softcap-gqa3", ((19, 1), (21, 5)), H=6, Hkv=2, sliding_window=9, softcap=3.0),
    Case("d256-softcap", ((10, 1), (7, 3)), H=2, Hkv=1, D=256, softcap=2.0),  # Gemma-2's head dim
]


# ---------------------------------------------------------------------------------------------
# the reference against the dense oracle


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_dense_oracle(case, dtype):
    batch = make_batch(case, dtype, seed=len(case.name))
    scale = case.D**-0.5 * 1.7  # not the default: a swapped scale must fail
    out = attention_reference.paged_attention_ref(*batch.args(), scale=scale, sliding_window=case.sliding_window,
                                                  softcap=case.softcap)
    assert out.dtype == dtype and out.shape == batch.q.shape
    want = dense_attention(batch, scale, case.sliding_window, case.softcap)
    assert rel_err(out, want) < (1e-12 if dtype == torch.float64 else 1e-6)


def test_reference_is_the_cpu_path_and_zeroes_padding(monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", None)
    case = CASES[1]
    batch = make_batch(case, torch.float32, seed=3)
    T = batch.q.shape[0]
    q = torch.cat([batch.q, torch.randn(2, case.H, case.D)])  # 2 trailing rows no sequence owns
    out = torch.full_like(q, float("nan"))
    assert paged_attention(q, *batch.args()[1:], scale=0.25, out=out) is out
    assert torch.isnan(out[T:]).all()
    out = out[:T]
    assert rel_err(out, dense_attention(batch, 0.25)) < 1e-6
    pad = [b for b, (L, _) in enumerate(case.seqs) if L == 0]
    qsl = batch.query_start_loc.tolist()
    for b in pad:
        assert torch.equal(out[qsl[b] : qsl[b + 1]], torch.zeros_like(out[qsl[b] : qsl[b + 1]]))


def test_reference_rejects_a_table_too_short_for_seq_len():
    batch = make_batch(Case("x", ((9, 1),)), seed=1)
    with pytest.raises(ValueError, match="seq_len"):
        attention_reference.paged_attention_ref(*batch.args()[:4], torch.tensor([99], dtype=torch.int32),
                                                batch.query_start_loc, scale=0.25)



def random_mixed_case(seed: int, sliding_window=None, softcap=None) -> Case:
    """Decodes, prefill chunks of varied lengths and a seq_len-0 padding row, shuffled, with GQA."""
    gen = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    seqs = [(ri(1, 40), 1) for _ in range(ri(3, 6))]  # decodes
    for _ in range(ri(2, 3)):  # prefills and chunks of a longer prompt
        L = ri(2, 45)
        seqs.append((L, ri(2, L)))
    seqs.append((0, 1))
    order = torch.randperm(len(seqs), generator=gen).tolist()
    return Case(f"random{seed}", tuple(seqs[i] for i in order), H=6, Hkv=2, D=16,
                sliding_window=sliding_window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("seed, sliding_window, softcap", [(0, None, None), (1, 7, None), (2, None, 2.5), (3, 11, 4.0)])
def test_batched_reference_matches_per_sequence_oracle_on_random_mixed_batches(seed, sliding_window, softcap, dtype):
    case = random_mixed_case(seed, sliding_window, softcap)
    batch = make_batch(case, dtype, seed=seed)
    T = batch.q.shape[0]
    q = torch.cat([batch.q, torch.randn(3, case.H, case.D, dtype=dtype)])  # rows past query_start_loc[B]
    out = torch.full_like(q, float("nan"))
    attention_reference.paged_attention_ref(q, *batch.args()[1:], scale=0.3, sliding_window=sliding_window,
                                            softcap=softcap, out=out)
    assert torch.isnan(out[T:]).all()
    want = dense_attention(batch, 0.3, sliding_window, softcap)
    assert rel_err(out[:T], want) < (1e-12 if dtype == torch.float64 else 1e-6)
    qsl = batch.query_start_loc.tolist()
    for b, (L, _) in enumerate(case.seqs):
        if L == 0:
            assert not out[qsl[b] : qsl[b + 1]].any()


def test_buckets_bound_the_padding_and_keep_every_sequence():
    gen = torch.Generator().manual_seed(0)
    rows = [(1, int(torch.randint(1, 2000, (1,), generator=gen)), b) for b in range(40)]  # decodes
    rows += [(n, n + 5 * b, 40 + b) for b, n in enumerate((3, 17, 64, 512))]  # prefill chunks
    buckets = attention_reference._buckets(rows)
    assert sorted(b for _, _, ids in buckets for b in ids) == list(range(44))
    assert 1 < len(buckets) < len(rows)
    by_id = {b: (n, L) for n, L, b in rows}
    for n_max, l_max, ids in buckets:
        assert (n_max, l_max) == (max(by_id[b][0] for b in ids), max(by_id[b][1] for b in ids))
        assert len(ids) * n_max * l_max <= 2 * sum(by_id[b][0] * by_id[b][1] for b in ids)

# ---------------------------------------------------------------------------------------------
# Triton under the interpreter (CPU)


def split_config(case: Case):
    from loramux.kernels.attention import AttentionConfig

    # three programs per query block, 16 keys each at least: the merge path on tiny sequences
    return AttentionConfig(max(16, case.H // case.Hkv), 16, 3, 4, 2, split_min_keys=16)


def wide_config(case: Case):
    from loramux.kernels.attention import AttentionConfig

    return AttentionConfig(64, 32, 1, 4, 2)  # prefill-style: many queries per program


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_interpreter_matches_reference(case, dtype):
    from loramux.kernels.attention import paged_attention_triton

    batch = make_batch(case, dtype, seed=len(case.name) + 1)
    scale = case.D**-0.5
    want = reference_of(batch, case, scale)
    configs = [None] + ([split_config(case), wide_config(case)] if dtype == torch.float32 else [])
    for config in configs:
        out = paged_attention_triton(*batch.args(), scale=scale, sliding_window=case.sliding_window,
                                     softcap=case.softcap, config=config)
        assert out.dtype == dtype and out.shape == batch.q.shape
        err = rel_err(out, want)
        assert err < TOL[dtype], f"config {config}: rel err {err:.2e}"


@needs_interpreter
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-kv"])
def test_triton_out_argument_and_padding_rows(split):
    """out= is written in place and returned; padding sequences (seq_len 0) get exact zeros; rows
    past query_start_loc[B] are not written."""
    from loramux.kernels.attention import paged_attention_triton

    case = CASES[1]
    batch = make_batch(case, torch.float32, seed=9)
    T = batch.q.shape[0]
    q = torch.cat([batch.q, torch.randn(2, case.H, case.D)])  # 2 trailing rows no sequence owns
    out = torch.full_like(q, float("nan"))
    config = split_config(case) if split else None
    got = paged_attention_triton(q, *batch.args()[1:], scale=0.3, out=out, config=config)
    assert got is out
    assert torch.isnan(out[T:]).all()
    assert rel_err(out[:T], reference_of(batch, case, 0.3)) < 1e-5
    qsl = batch.query_start_loc.tolist()
    for b, (L, _) in enumerate(case.seqs):
        if L == 0:
            assert torch.equal(out[qsl[b] : qsl[b + 1]], torch.zeros(qsl[b + 1] - qsl[b], case.H, case.D))


@needs_interpreter
def test_triton_dispatch_and_strided_query(monkeypatch):
    """LORAMUX_KERNELS=triton routes the public function to the kernel; q may be a strided view
    (a slice of a fused qkv output)."""
    setenv(monkeypatch, "LORAMUX_KERNELS", "triton")
    case = Case("strided", ((13, 1), (9, 4)), H=4, Hkv=2, D=32)
    batch = make_batch(case, torch.float16, seed=4)
    T = batch.q.shape[0]
    qkv = torch.randn(T, case.H + 2 * case.Hkv, case.D, dtype=torch.float16)
    qkv[:, : case.H] = batch.q
    out = paged_attention(qkv[:, : case.H], *batch.args()[1:], scale=0.2)
    assert rel_err(out, reference_of(batch, case, 0.2)) < 1e-2


@needs_interpreter
def test_triton_launch_depends_on_shapes_only(monkeypatch):
    """Two batches with the same shapes but different lengths, query splits and tables launch the
    same grid with the same arguments except the tensors' data (CUDA-graph replay relies on it)."""
    from loramux.kernels import attention as pa

    launches = []
    real = pa._paged_attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, [a for a in args if not isinstance(a, torch.Tensor)], kwargs))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(pa, "_paged_attention_kernel", Recorder())
    a = make_batch(Case("a", ((9, 1), (20, 6), (3, 3))), seed=1)
    b = make_batch(Case("b", ((30, 5), (1, 1), (0, 4))), seed=2)
    b.k_cache, b.v_cache = a.k_cache, a.v_cache  # same cache tensors, other tables
    b.block_tables = b.block_tables[:, : a.block_tables.shape[1]] % a.k_cache.shape[0]
    for batch in (a, b):
        pa.paged_attention_triton(*batch.args(), scale=0.3)
    assert len(launches) == 2 and launches[0] == launches[1]


@needs_interpreter
def test_triton_int64_metadata_and_head_dim_limit():
    from loramux.kernels.attention import paged_attention_triton

    case = Case("int64", ((11, 1), (9, 3)))
    batch = make_batch(case, torch.float32, seed=6)
    q, kc, vc, bt, sl, qsl = batch.args()
    out = paged_attention_triton(q, kc, vc, bt.long(), sl.long(), qsl.long(), scale=0.25)
    assert rel_err(out, reference_of(batch, case, 0.25)) < 1e-5
    big = torch.zeros(2, 8, 1, 272)
    with pytest.raises(ValueError, match="head_dim 272"):
        paged_attention_triton(torch.zeros(4, 1, 272), big, big, bt, sl, qsl, scale=0.25)


def test_importing_the_kernel_module_keeps_the_public_functions():
    """A submodule named like a function of the package would replace it on first import."""
    import importlib

    import loramux.kernels as kernels

    importlib.import_module("loramux.kernels.attention")
    importlib.import_module("loramux.kernels.attention_reference")
    assert kernels.paged_attention is paged_attention and callable(kernels.paged_attention)
    assert kernels.write_kv is write_kv and callable(kernels.write_kv)


# ---------------------------------------------------------------------------------------------
# write_kv


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_write_kv_writes_exactly_the_given_slots(impl, dtype, monkeypatch):
    if impl == "triton" and not INTERPRET:
        pytest.skip("needs the interpreter on CPU")
    setenv(monkeypatch, "LORAMUX_KERNELS", impl)
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, hkv, D = 5, 8, 3, 24
    k_cache = torch.randn(num_blocks, bs, hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, D, generator=gen).to(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, -1, 0, 39, -1, 8, 31])
    key = torch.randn(len(slots), hkv, D, generator=gen).to(dtype)
    value = torch.randn(len(slots), hkv, D, generator=gen).to(dtype)
    for index_dtype in (torch.int64, torch.int32):
        k_cache.copy_(k0)
        v_cache.copy_(v0)
        write_kv(key, value, k_cache, v_cache, slots.to(index_dtype))
        k_want, v_want = k0.clone(), v0.clone()
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                k_want[s // bs, s % bs] = key[t]
                v_want[s // bs, s % bs] = value[t]
        assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    write_kv(key[:0], value[:0], k_cache, v_cache, slots[:0])  # an empty step is fine


# ---------------------------------------------------------------------------------------------
# argument checks (shared by Triton and the reference)


def _good():
    batch = make_batch(Case("good", ((9, 1), (6, 3))), seed=2)
    return list(batch.args())


ATTENTION_ERRORS = [
    (lambda a: a.__setitem__(0, a[0][0]), "q must be a 3-D"),
    (lambda a: a.__setitem__(0, a[0][..., :8]), "head_dim mismatch"),
    (lambda a: a.__setitem__(0, a[0].half()), "q is torch.float16 but the cache"),
    (lambda a: a.__setitem__(0, a[0][:, :3]), "not a multiple of num_kv_heads"),
    (lambda a: a.__setitem__(2, a[2][:, :, :1]), "allocate both"),
    (lambda a: a.__setitem__(1, a[1][0]), "k_cache must be a 4-D"),
    (lambda a: (a.__setitem__(1, a[1][:, :6]), a.__setitem__(2, a[2][:, :6])), "power of two"),
    (lambda a: a.__setitem__(1, a[1].int()), "dtype"),
    (lambda a: a.__setitem__(3, a[3].float()), "block_tables must be"),
    (lambda a: a.__setitem__(4, a[4][:1]), "seq_lens must be"),
    (lambda a: a.__setitem__(5, a[5][:2]), r"query_start_loc must be an int32 tensor of shape \[3\]"),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mutate, match", ATTENTION_ERRORS, ids=[m for _, m in ATTENTION_ERRORS])
def test_paged_attention_rejects_bad_arguments(impl, mutate, match, monkeypatch):
    if impl == "triton" and not INTERPRET:
        pytest.skip("needs the interpreter on CPU")
    setenv(monkeypatch, "LORAMUX_KERNELS", impl)
    args = _good()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_attention(*args, scale=0.25)


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale=0.0), "scale"),
    (dict(scale=0.25, sliding_window=0), "sliding_window"),
    (dict(scale=0.25, softcap=-1.0), "softcap"),
    (dict(scale=0.25, out=torch.zeros(4, 4, 8)), "out must be"),
])
def test_paged_attention_rejects_bad_options(kwargs, match, monkeypatch):
    setenv(monkeypatch, "LORAMUX_KERNELS", "torch")
    with pytest.raises(ValueError, match=match):
        paged_attention(*_good(), **kwargs)


WRITE_ERRORS = [
    (lambda k, v, kc, vc, s: (k[0], v, kc, vc, s), "key must be a 3-D"),
    (lambda k, v, kc, vc, s: (k, v[:2], kc, vc, s), "must match"),
    (lambda k, v, kc, vc, s: (k[:, :1], v[:, :1], kc, vc, s), "kv heads"),
    (lambda k, v, kc, vc, s: (k.half(), v.half(), kc, vc, s), "cast them to the cache dtype"),
    (lambda k, v, kc, vc, s: (k, v, kc[:, :3], vc[:, :3], s), "power of two"),
    (lambda k, v, kc, vc, s: (k, v, kc, vc, s[:2]), "slot_mapping must be"),
    (lambda k, v, kc, vc, s: (k, v, kc, vc, s.float()), "slot_mapping must be"),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mutate, match", WRITE_ERRORS, ids=[m for _, m in WRITE_ERRORS])
def test_write_kv_rejects_bad_arguments(impl, mutate, match, monkeypatch):
    if impl == "triton" and not INTERPRET:
        pytest.skip("needs the interpreter on CPU")
    setenv(monkeypatch, "LORAMUX_KERNELS", impl)
    kc, vc = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match=match):
        write_kv(*mutate(k, v, kc, vc, torch.tensor([0, 5, -1])))


# ---------------------------------------------------------------------------------------------
# GPU: bfloat16 on Llama-3.1-8B shapes (H=32, Hkv=8, D=128, block 16), CUDA graphs


def llama_case(name, seqs, **kw):
    return Case(name, tuple(seqs), H=32, Hkv=8, D=128, block_size=16, **kw)


def gpu_batch(case: Case, seed: int) -> Batch:
    """make_batch's layout built on the GPU directly (the CPU helper is slow at these sizes)."""
    batch = make_batch(Case(case.name, tuple((0, n) for _, n in case.seqs), case.H, case.Hkv, case.D,
                            case.block_size), torch.bfloat16, "cuda", seed,
                       spare_blocks=sum(-(-L // case.block_size) for L, _ in case.seqs) + 1)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bs = case.block_size
    num_blocks = batch.k_cache.shape[0]
    max_blocks = max(-(-L // bs) for L, _ in case.seqs) + 1
    ids = torch.randperm(num_blocks, device="cuda", generator=gen)
    tables = torch.randint(0, num_blocks, (len(case.seqs), max_blocks), device="cuda", generator=gen)
    used = 0
    for b, (L, _) in enumerate(case.seqs):
        n = -(-L // bs)
        tables[b, :n] = ids[used : used + n]
        used += n
        k = torch.randn(L, case.Hkv, case.D, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(L, case.Hkv, case.D, device="cuda", generator=gen, dtype=torch.bfloat16)
        pos = torch.arange(L, device="cuda")
        write_kv(k, v, batch.k_cache, batch.v_cache, tables[b, pos // bs].long() * bs + pos % bs)
    batch.block_tables = tables.to(torch.int32)
    batch.seq_lens = torch.tensor([L for L, _ in case.seqs], dtype=torch.int32, device="cuda")
    return batch


def reference_f32(batch: Batch, case: Case, scale: float) -> torch.Tensor:
    args = [t.float() if t.is_floating_point() else t for t in batch.args()]
    return attention_reference.paged_attention_ref(*args, scale=scale, sliding_window=case.sliding_window,
                                                   softcap=case.softcap)


def _gpu_cases():
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(1, 2049, (64,), generator=g).tolist()
    return [
        llama_case("decode-b64", [(L, 1) for L in ctx]),
        llama_case("mixed", [(L, 1) for L in ctx[:48]] + [(512, 512), (1500, 300), (0, 1), (2048, 64)]),
        llama_case("split-kv-b2", [(8192, 1), (5000, 1)]),
        llama_case("window-softcap", [(L, 1) for L in ctx[:16]] + [(900, 200)], sliding_window=256, softcap=50.0),
        Case("gemma2-d256", tuple((L, 1) for L in ctx[:32]) + ((700, 120),), H=16, Hkv=8, D=256, block_size=16,
             sliding_window=512, softcap=50.0),
    ]


@pytest.mark.gpu
@needs_cuda
class TestGPU:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
    def test_small_cases_every_dtype_and_config(self, dtype):
        """The interpreter's matrix on the GPU, bfloat16 included (the interpreter gets it wrong)."""
        from loramux.kernels.attention import paged_attention_triton

        for case in CASES:
            batch = make_batch(case, dtype, "cuda", seed=len(case.name) + 1)
            want = reference_of(batch, case, case.D**-0.5)
            for config in (None, split_config(case), wide_config(case)):
                out = paged_attention_triton(*batch.args(), scale=case.D**-0.5, sliding_window=case.sliding_window,
                                             softcap=case.softcap, config=config)
                err = rel_err(out, want)
                assert err < TOL[dtype], f"{case} {config}: rel err {err:.2e}"

    def test_write_kv_on_gpu(self):
        k_cache = torch.randn(6, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        slots = torch.tensor([95, -1, 0, 17, 16, -1], device="cuda")
        key = torch.randn(6, 8, 128, device="cuda", dtype=torch.bfloat16)
        value = torch.randn_like(key)
        write_kv(key, value, k_cache, v_cache, slots.to(torch.int32))
        attention_reference.write_kv_ref(key, value, k_want, v_want, slots)
        assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)

    @pytest.mark.parametrize("case", _gpu_cases(), ids=str)
    def test_bf16_matches_reference(self, case, monkeypatch):
        setenv(monkeypatch, "LORAMUX_KERNELS", None)  # default dispatch must pick Triton
        batch = gpu_batch(case, seed=1)
        out = paged_attention(*batch.args(), scale=case.D**-0.5, sliding_window=case.sliding_window,
                              softcap=case.softcap)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, reference_f32(batch, case, case.D**-0.5)) < 1e-2

    def test_never_syncs(self):
        case = _gpu_cases()[1]
        batch = gpu_batch(case, seed=2)
        paged_attention(*batch.args(), scale=0.1)  # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            paged_attention(*batch.args(), scale=0.1)
            write_kv(batch.q[:, : case.Hkv], batch.q[:, case.Hkv : 2 * case.Hkv], batch.k_cache, batch.v_cache,
                     torch.arange(batch.q.shape[0], device="cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()

    @pytest.mark.parametrize("B", [64, 2], ids=["b64", "b2-split"])
    def test_cuda_graph_replay_with_new_metadata(self, B):
        """Capture once with static metadata tensors; copy another batch's seq_lens, block tables
        and query_start_loc in and replay: the result is the new batch's."""
        g = torch.Generator().manual_seed(B)
        cases = [llama_case(f"g{i}", [(int(L), 1) for L in torch.randint(1, 4097, (B,), generator=g)])
                 for i in range(2)]
        cases[1] = llama_case("g1", [(L, 1) for L, _ in cases[1].seqs[:-1]] + [(0, 1)])  # a padding row
        batches = [gpu_batch(c, seed=i) for i, c in enumerate(cases)]
        max_blocks = max(b.block_tables.shape[1] for b in batches)
        # one cache for both: the second batch's blocks follow the first's
        k_cache = torch.cat([batches[0].k_cache, batches[1].k_cache])
        v_cache = torch.cat([batches[0].v_cache, batches[1].v_cache])
        shift = batches[0].k_cache.shape[0]
        static_q = batches[0].q.clone()
        static_tables = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
        static_lens = torch.zeros(B, dtype=torch.int32, device="cuda")
        static_qsl = batches[0].query_start_loc.clone()
        out = torch.empty_like(static_q)

        def load(i):
            bt = batches[i].block_tables + (shift if i == 1 else 0)
            static_tables.zero_()
            static_tables[:, : bt.shape[1]] = bt
            static_lens.copy_(batches[i].seq_lens)
            static_q.copy_(batches[i].q)

        def step():
            paged_attention(static_q, k_cache, v_cache, static_tables, static_lens, static_qsl, scale=0.088, out=out)

        load(0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for i in (1, 0):
            load(i)
            graph.replay()
            torch.cuda.synchronize()
            want = attention_reference.paged_attention_ref(
                static_q.float(), k_cache.float(), v_cache.float(), static_tables, static_lens, static_qsl,
                scale=0.088)
            assert rel_err(out, want) < 1e-2, f"replay with batch {i}"
            if i == 1:
                assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the padding row
