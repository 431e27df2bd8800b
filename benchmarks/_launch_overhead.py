"""Host time per call of the Triton launchers (GPU): where an eager step's Python goes."""
import time, sys, torch
sys.path.insert(0, ".")
from loramux.kernels import build_lora_meta
from loramux.kernels import shrink, expand, attention, checks
from loramux.kernels.shrink import lora_shrink_triton, shrink_launch
from loramux.kernels.expand import lora_expand_triton

dev = torch.device("cuda")
T, H, S, R = 128, 4096, 8, 16
sizes = (4096, 1024, 1024)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
A = torch.randn(S, 3 * R, H, device=dev, dtype=torch.bfloat16) * 0.01
B = torch.randn(S, sum(sizes), R, device=dev, dtype=torch.bfloat16) * 0.01
sc = torch.ones(S, 3, device=dev)
ranks = torch.full((S,), R, dtype=torch.int32, device=dev)
y = torch.zeros(T, sum(sizes), device=dev, dtype=torch.bfloat16)
slots = torch.zeros(T, dtype=torch.int32, device=dev)
meta = build_lora_meta(slots, S)

def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t

print("shrink full", host_us(lambda: lora_shrink_triton(x, A, sc, meta, ranks)))
buf = lora_shrink_triton(x, A, sc, meta, ranks)
print("expand full", host_us(lambda: lora_expand_triton(y, buf, B, sizes, meta, ranks)))
print("check_shrink", host_us(lambda: checks.check_shrink(x, A, sc, meta, ranks)))
print("check_expand", host_us(lambda: checks.check_expand(y, buf, B, sizes, meta, ranks)))
print("shrink_launch", host_us(lambda: shrink_launch(meta, 48, H, x.dtype, dev)))
print("empty", host_us(lambda: torch.empty(16, T, 48, device=dev)))
print("build_lora_meta", host_us(lambda: build_lora_meta(slots, S), 50))
print("triton version", __import__("triton").__version__)
# attention at prefill: one 128-token sequence
from loramux.kernels.attention import paged_attention_triton, write_kv_triton
kc = torch.zeros(64, 16, 8, 128, device=dev, dtype=torch.bfloat16); vc = kc.clone()
q = torch.randn(T, 32, 128, device=dev, dtype=torch.bfloat16)
bt = torch.arange(8, dtype=torch.int32, device=dev)[None]
sl = torch.tensor([T], dtype=torch.int32, device=dev)
qs = torch.tensor([0, T], dtype=torch.int32, device=dev)
out = torch.empty_like(q)
print("attention full", host_us(lambda: paged_attention_triton(q, kc, vc, bt, sl, qs, scale=0.088, out=out)))
k = torch.randn(T, 8, 128, device=dev, dtype=torch.bfloat16)
sm = torch.arange(T, device=dev)
print("write_kv full", host_us(lambda: write_kv_triton(k, k, kc, vc, sm)))
# raw JIT launch of a trivial kernel with many args
import triton, triton.language as tl
@triton.jit
def _noop(p, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, N: tl.constexpr):
    pass
args = [x] + [3] * 20
print("noop 21 args", host_us(lambda: _noop[(1,)](*args, N=4)))
import cProfile, pstats, io
pr = cProfile.Profile(); pr.enable()
for _ in range(200):
    lora_shrink_triton(x, A, sc, meta, ranks)
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue())
