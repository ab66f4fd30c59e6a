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
import inspect
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmserve.triton_kernels.gemv import _gemv_kernel  # noqa: E402

# (label, K, N, block_n, block_k, warps, red, glu, prologue): bf16 decode shapes of the tuned table
SHAPES = [("1.5B gate-up", 1536, 8960, 1, 512, 1, 8, True, 1),
          ("1.5B down", 8960, 1536, 1, 1024, 4, 1, False, 0),
          ("1.5B LM head", 1536, 151936, 4, 512, 2, 1, False, 0),
          ("7B gate-up", 3584, 18944, 2, 512, 2, 1, True, 1),
          ("7B down", 18944, 3584, 4, 512, 8, 1, False, 0),
          ("0.5B down", 4864, 896, 1, 1024, 4, 1, False, 0),
          ("0.5B LM head", 896, 151936, 4, 128, 2, 1, False, 0)]
_PTRS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "scale_ptr": "*bf16", "bias_ptr": "*bf16",
         "res_ptr": "*bf16", "g_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "cos_ptr": "*fp32",
         "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "ids_ptr": "*bf16"}
_SCALARS = {"num_slots": "i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
            "stride_ym": "i32", "stride_rm": "i32", "eps": "fp32"}
_DIVISIBLE = set(_PTRS) | {"K", "N", "stride_xm", "stride_wn", "stride_ym", "stride_rm"}


def resource_usage(k: int, block_n: int, block_k: int, warps: int, red: int, pre: int, glu: bool,
                   prologue: int) -> str:
    """``cuobjdump -res-usage``'s ``REG / STACK / SHARED`` of one M = 1, bf16, PDL launch."""
    names = list(inspect.signature(_gemv_kernel.fn).parameters)
    const = dict(W_INT8=False, HAS_BIAS=False, HAS_RES=False, PROLOGUE=prologue, GLU=glu, ROPE=False, HQ=1,
                 HKV=1, HALF=1, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, STAGES=1,
                 PERSISTENT=False, USE_PDL=True, EARLY_EPI=0, PDL_TRIGGER_FIRST=False, PLANES=False,
                 X_GATHER=False, RES_GATHER=False, RED=red, PRE=min(pre, triton.cdiv(k, block_k)))
    sig = {n: _PTRS.get(n) or _SCALARS.get(n) or "constexpr" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in _DIVISIBLE}
    kernel = triton.compile(ASTSource(_gemv_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
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
    for label, k, n, bn, bk, warps, red, glu, prologue in SHAPES:
        for pre in args.pre:
            print(f"{label:14s} [{bn}, {bk}, {warps} warps, red {red}] pre {pre}: "
                  f"{resource_usage(k, bn, bk, warps, red, pre, glu, prologue)}")


if __name__ == "__main__":
    main()
