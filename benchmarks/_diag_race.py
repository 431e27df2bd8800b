"""qkv then gate_up, eager static meta, 32 adapters: which interaction breaks gate_up."""
import sys, dataclasses, torch
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from test_kernels import per_slice_rank_inputs
from loramux.kernels import build_lora_meta, reference
from loramux.kernels import shrink as shrink_mod
from loramux.kernels.shrink import lora_shrink_triton, static_shrink_config, _lock_table
from loramux.kernels.expand import lora_expand_triton

T, S, R = 64, 32, 16
MODS = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}
W = {}
for name, (H, sizes) in MODS.items():
    x, A, B, scales, ranks, _ = per_slice_rank_inputs(T, H, S, R, sizes, torch.float32, seed=H + 1)
    ranks[:2] = R; A[:2].normal_(std=H**-0.5); B[:2].normal_(std=R**-0.5)
    W[name] = tuple(t.cuda() for t in (x.bfloat16(), A.bfloat16(), B.bfloat16(), scales, ranks)) + (sizes,)
slots = (torch.arange(T) % S).to(torch.int32).cuda()
meta64 = build_lora_meta(slots.cpu(), S)
REF = {}
for name, (x, A, B, scales, ranks, sizes) in W.items():
    REF[name] = reference.lora_shrink_ref(x.double().cpu(), A.double().cpu(), scales.double().cpu(), meta64, ranks.cpu())

def run(order, sync=False, zero_table=False, split1=(), warps8=()):
    meta = build_lora_meta(slots, S, static=True)
    errs, bufs = {}, []
    for name in order:
        x, A, B, scales, ranks, sizes = W[name]
        cfg = None
        if name in split1:
            cfg = dataclasses.replace(static_shrink_config(T, A.shape[1], x.shape[1], x.dtype, x.device), split_k=1)
        if name in warps8:
            cfg = dataclasses.replace(static_shrink_config(T, A.shape[1], x.shape[1], x.dtype, x.device), num_warps=8)
        buf = lora_shrink_triton(x, A, scales, meta, ranks, config=cfg)
        if sync:
            torch.cuda.synchronize()
            errs[name + " table!=0"] = int((_lock_table(x.device) != 0).sum())
        if zero_table:
            _lock_table(x.device).zero_()
        bufs.append((name, buf))
    torch.cuda.synchronize()
    out = {}
    for i, (name, b) in enumerate(bufs):
        out[f"{i}:{name}"] = round(((b.double().cpu() - REF[name]).norm() / REF[name].norm()).item(), 4)
    out.update(errs)
    return out

for label, kw in [("qkv,gate_up", dict(order=["qkv", "gate_up"])),
                  ("qkv,gate_up sync", dict(order=["qkv", "gate_up"], sync=True)),
                  ("qkv,gate_up zero table", dict(order=["qkv", "gate_up"], zero_table=True)),
                  ("gate_up,qkv", dict(order=["gate_up", "qkv"])),
                  ("qkv split1,gate_up", dict(order=["qkv", "gate_up"], split1=("qkv",))),
                  ("qkv,gate_up split1", dict(order=["qkv", "gate_up"], split1=("gate_up",))),
                  ("qkv,gate_up split1,qkv", dict(order=["qkv", "gate_up", "qkv"], split1=("gate_up",))),
                  ("qkv,gate_up warps8", dict(order=["qkv", "gate_up"], warps8=("gate_up",))),
                  ("qkv,down", dict(order=["qkv", "down"])),
                  ("qkv,gate_up,down", dict(order=["qkv", "gate_up", "down"]))]:
    print(label, run(**kw), flush=True)
print("table now", int((_lock_table(torch.device("cuda")) != 0).sum()), _lock_table(torch.device("cuda"))[:120].tolist())
