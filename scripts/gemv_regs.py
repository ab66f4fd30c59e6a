#!/usr/bin/env python3
"""Registers a thread of the matrix-vector kernel (``triton_kernels/gemv.py``) needs, per launch
configuration, compiled for sm_90 on any machine (no GPU needed): ``triton.compile`` of the
kernel with the launch's constexprs and 16-byte divisibility on pointers, strides and sizes,
then ``cuobjdump -res-usage`` (the one Triton ships) on the cubin. The local Triton may differ
from the device's, so counts are indicative. Why it matters: a program's registers set how
many programs share an SM (65,536 registers, at most 32 programs), and with that how many
weight bytes are in flight.

Usage: python3 scripts/gemv_regs.py [--pre 1 2 3 4]
Prints one line per (shape, pre): registers, stack and shared memory per program.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmserve.triton_kernels.gemv import GemvConfig, _gemv_kernel, _tuned  # noqa: E402

# (label, table prologue, K, N): bf16 M = 1 decode shapes; their tiles come from the packaged
# table (gemv_configs.json) for this GPU name
GPU = "NVIDIA H200"
SHAPES = [("1.5B gate-up", "rmsnorm+glu", 1536, 8960), ("1.5B down", "none", 8960, 1536),
          ("1.5B LM head", "none", 1536, 151936), ("7B gate-up", "rmsnorm+glu", 3584, 18944),
          ("7B down", "none", 18944, 3584), ("0.5B down", "none", 4864, 896),
          ("0.5B LM head", "none", 896, 151936)]
_PTRS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "scale_ptr": "*bf16", "bias_ptr": "*bf16",
         "res_ptr": "*bf16", "g_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "cos_ptr": "*fp32",
         "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "ids_ptr": "*bf16"}
_SCALARS = {"num_slots": "i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
            "stride_ym": "i32", "stride_rm": "i32", "eps": "fp32"}
_DIVISIBLE = set(_PTRS) | {"K", "N", "stride_xm", "stride_wn", "stride_ym", "stride_rm"}


def resource_usage(k: int, cfg: GemvConfig, glu: bool, prologue: int) -> str:
    """``cuobjdump -res-usage``'s ``REG / STACK / SHARED`` of one M = 1, bf16, PDL launch of
    ``cfg`` (one row block a program; ``pre`` capped at the row's tile count, as launched)."""
    names = list(inspect.signature(_gemv_kernel.fn).parameters)
    const = dict(W_INT8=False, HAS_BIAS=False, HAS_RES=False, PROLOGUE=prologue, GLU=glu, ROPE=False, HQ=1,
                 HKV=1, HALF=1, BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 EVEN_K=k % cfg.block_k == 0, STAGES=cfg.stages, PERSISTENT=False, USE_PDL=True, EARLY_EPI=0,
                 PDL_TRIGGER_FIRST=False, PLANES=False, X_GATHER=False, RES_GATHER=False, RED=cfg.red,
                 PRE=min(cfg.pre, triton.cdiv(k, cfg.block_k)))
    sig = {n: _PTRS.get(n) or _SCALARS.get(n) or "constexpr" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in _DIVISIBLE}
    kernel = triton.compile(ASTSource(_gemv_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    return f"{m.group(1)} registers, {m.group(2)} B stack, {m.group(3)} B shared" if m else out.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pre", type=int, nargs="+", default=[1, 2, 3, 4])
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    for label, prologue, k, n in SHAPES:
        cfg = _tuned(GPU, "float", prologue, 1, k, n)
        if cfg is None:
            print(f"{label:14s} no {GPU} entry in the table")
            continue
        for pre in args.pre:
            c = dataclasses.replace(cfg, pre=pre)
            print(f"{label:14s} [{c.block_n}, {c.block_k}, {c.num_warps} warps, red {c.red}] pre {pre}: "
                  f"{resource_usage(k, c, 'glu' in prologue, int(prologue.startswith('rmsnorm')))}")


if __name__ == "__main__":
    main()
