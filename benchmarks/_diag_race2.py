import sys, torch
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from test_kernels import per_slice_rank_inputs
from loramux.kernels import build_lora_meta, reference
from loramux.kernels.shrink import lora_shrink_triton, _shrink_kernel
T, S, R = 64, 32, 16
first = sys.argv[1]
MODS = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336))}
W = {}
for name, (H, sizes) in MODS.items():
    x, A, B, scales, ranks, _ = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=H + 1)
    ranks[:2] = R; A[:2].normal_(std=H**-0.5)
    W[name] = tuple(t.cuda() for t in (x.bfloat16(), A.bfloat16(), scales, ranks))
for mapping_name, mapping in (("32", torch.arange(T) % S), ("one", torch.full((T,), 7))):
    slots = mapping.to(torch.int32).cuda()
    meta64 = build_lora_meta(slots.cpu(), S)
    order = [first] + [n for n in MODS if n != first]
    for name in order:
        x, A, scales, ranks = W[name]
        meta = build_lora_meta(slots, S, static=True)
        buf = lora_shrink_triton(x, A, scales, meta, ranks)
        torch.cuda.synchronize()
        ref = reference.lora_shrink_ref(x.double().cpu(), A.double().cpu(), scales.double().cpu(), meta64, ranks.cpu())
        d = (buf.double().cpu() - ref).abs()
        bad = d > 1e-2 * ref.abs().max()
        print(first, mapping_name, name, "err", round((d.norm() / ref.norm()).item(), 4), "bad rows", bad.any(1).nonzero().flatten().tolist()[:64],
              "bad cols", bad.any(0).nonzero().flatten().tolist(), "slots of bad rows", sorted(set(slots.cpu()[bad.any(1)].tolist())), flush=True)
        if bad.any():
            r = int(bad.any(1).nonzero()[0]); print("  row", r, "slot", int(slots[r]), "rank", int(ranks[int(slots[r])]), "got", buf[r].cpu()[:32].tolist()[:8], "ref", ref[r][:8].tolist())
for dev, caches in _shrink_kernel.device_caches.items():
    for key in caches[0]:
        print("cache key", str(key)[:400])
