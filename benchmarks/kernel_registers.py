"""Registers and spills of the fused LoRA kernel at Llama-3.1-8B shapes, compiled for a GPU without one.

    PYTHONPATH=. python benchmarks/kernel_registers.py                # sm_90 (H100/H200), bf16
    PYTHONPATH=. python benchmarks/kernel_registers.py --arch 80 --max-regs 0

Triton compiles to a cubin on any machine (its wheel ships ptxas); cuobjdump reads the cubin's
register count and stack (spill) bytes. A block of 4 warps at R registers a thread leaves
65536 / (128 R) blocks on an SM, so 255 registers mean 2 blocks and 128 mean 4: on a CPU-only
machine this is the one performance number of a kernel change that can be checked. Uses
Triton's compiler entry point (`triton.compile(ASTSource(...))`), not the launcher.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the shell says
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

MODULES = [("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate_up", 4096, (14336, 14336)),
           ("down", 14336, (4096,))]
#: strides the launcher's arguments make 1 (Triton specializes them as constants)
UNIT_STRIDES = {"stride_yn", "stride_xk", "stride_ak", "stride_sn", "stride_wk"}


def compile_fused(H: int, sizes: tuple[int, ...], R: int, cfg, arch: int, S: int = 32, dtype: str = "bf16"):
    """The cubin `lora_fused_triton` would launch for this module shape and config (16-bit y, ranks given)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loramux.kernels import fused, fused_config
    from loramux.kernels.tiles import next_pow2

    fn = fused._fused_kernel
    pointers = {"y_ptr": dtype, "x_ptr": dtype, "a_ptr": dtype, "b_ptr": dtype, "scales_ptr": "fp32",
                "ranks_ptr": "i32", "part_ptr": "fp32", "sync_ptr": "i32", "slice_tab_ptr": "i32",
                "sorted_ids_ptr": "i32", "counts_ptr": "i32", "starts_ptr": "i32", "slots_ptr": "i32"}
    constexprs = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=max(16, next_pow2(R)), BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, A_PAD=max(32, next_pow2(S)), S_PAD=max(16, next_pow2(S)),
        SL_PAD=max(2, next_pow2(len(sizes))), SYNC_PAIRS=fused_config.SYNC_TABLE_PAIRS, HAS_RANKS=True,
        EVEN_K=H % cfg.block_k == 0, CAST_BUF=True, PRECISION="tf32", Y_VEC=8, W_VEC=8 if R % 8 == 0 else 1,
        SPIN_LIMIT=fused.SPIN_LIMIT, FALLBACK_K=min(fused.FALLBACK_BLOCK_K, cfg.block_k), PREFETCH=cfg.prefetch,
        **{name: 1 for name in UNIT_STRIDES},
    )
    signature = {name: ("constexpr" if name in constexprs else f"*{pointers[name]}" if name in pointers else "i32")
                 for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.max_regs:
        options["maxnreg"] = cfg.max_regs
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def resources(kernel) -> dict:
    """{'regs', 'stack'} from the cubin (cuobjdump ships with Triton's NVIDIA backend)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no register count:\n{text}")
    return {"regs": int(found.group(1)), "stack": int(found.group(2))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--max-regs", type=int, default=None, help="override the config's register cap (0: none)")
    args = ap.parse_args(argv)
    import torch

    from loramux.kernels.fused_config import _static_fused_config

    for name, H, sizes in MODULES:
        for R in (int(r) for r in args.ranks.split(",")):
            cfg = _static_fused_config(args.tokens, H, sizes, R, torch.bfloat16, 264)  # 132 SMs
            if args.max_regs is not None:
                cfg = dataclasses.replace(cfg, max_regs=args.max_regs or None)
            use = resources(compile_fused(H, sizes, R, cfg, args.arch))
            print(f"{name:8s} r{R:<3d} regs {use['regs']:3d} spill stack {use['stack']:5d} B | {cfg}", flush=True)


if __name__ == "__main__":
    main()
