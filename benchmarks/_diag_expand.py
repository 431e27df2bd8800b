"""Diagnose test_gpu_graph_captured_with_all_base_rows_replays_any_mix's failure at (14336, 14336)."""
import sys, dataclasses, torch
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from test_kernels import per_slice_rank_inputs
from loramux.kernels import build_lora_meta, reference
from loramux.kernels.shrink import lora_shrink_triton, static_shrink_config, _lock_table
from loramux.kernels.expand import lora_expand_triton, static_expand_config

T, S, R = 64, 32, 16
for H, sizes in [(4096, (14336, 14336)), (4096, (4096, 1024, 1024)), (4096, (28672,)), (4096, (14336,))]:
    x, A, B, scales, ranks, _ = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=H + 1)
    ranks[:2] = R; A[:2].normal_(std=H**-0.5); B[:2].normal_(std=R**-0.5)
    x, A, B, scales, ranks = (t.cuda() for t in (x.bfloat16(), A.bfloat16(), B.bfloat16(), scales, ranks))
    y0 = torch.randn(T, sum(sizes), device="cuda").bfloat16()
    for mname, mapping in (("one", torch.full((T,), 7)), ("32", torch.arange(T) % S), ("slot3", torch.full((T,), 3))):
        slots = mapping.to(torch.int32).cuda()
        meta64 = build_lora_meta(slots.cpu(), S)
        buf_ref = reference.lora_shrink_ref(x.double().cpu(), A.double().cpu(), scales.double().cpu(), meta64, ranks.cpu())
        y_ref = y0.double().cpu().clone()
        reference.lora_expand_ref(y_ref, buf_ref, B.double().cpu(), sizes, meta64, ranks.cpu())
        d_ref = y_ref - y0.double().cpu()
        def err(y):
            return ((y.double().cpu() - y0.double().cpu() - d_ref).norm() / d_ref.norm()).item()
        out = {}
        for static in (True, False):
            meta = build_lora_meta(slots, S, static=static)
            buf = lora_shrink_triton(x, A, scales, meta, ranks)
            torch.cuda.synchronize()
            out[f"shrink err static={static}"] = ((buf.double().cpu() - buf_ref).norm() / buf_ref.norm()).item()
            y = y0.clone(); lora_expand_triton(y, buf, B, sizes, meta, ranks); torch.cuda.synchronize()
            out[f"both static={static}"] = err(y)
            y = y0.clone(); lora_expand_triton(y, buf_ref.float().cuda(), B, sizes, meta, ranks); torch.cuda.synchronize()
            out[f"expand(ref buf) static={static}"] = err(y)
            if static:
                cfg = static_expand_config(T, sizes, R, torch.bfloat16, x.device)
                for g in (1, 2, 4):
                    c = dataclasses.replace(cfg, group=g, num_stages=3 if g > 1 else 2)
                    y = y0.clone(); lora_expand_triton(y, buf_ref.float().cuda(), B, sizes, meta, ranks, config=c)
                    torch.cuda.synchronize(); out[f"expand(ref buf) group={g} stages={c.num_stages}"] = err(y)
                c = dataclasses.replace(cfg, num_stages=1)
                y = y0.clone(); lora_expand_triton(y, buf_ref.float().cuda(), B, sizes, meta, ranks, config=c)
                torch.cuda.synchronize(); out[f"expand(ref buf) group={cfg.group} stages=1"] = err(y)
                out["cfg"] = str(cfg)
        out["lock table nonzero"] = int((_lock_table(x.device) != 0).sum())
        print(sizes, mname, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}, flush=True)
