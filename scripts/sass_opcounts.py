"""Opcode counts of the SASS of Triton-compiled kernels in a Triton cache directory (GPU
machine or anywhere the cubins are): which instructions a kernel variant actually runs, e.g.
whether an int8 -> float conversion became ``I2F`` (conversion pipe, 16 a clock per SM on
Hopper) or integer/float adds.

    python scripts/sass_opcounts.py $TRITON_CACHE_DIR [--kernel _gemv_kernel] [--ops I2F PRMT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
from pathlib import Path


def nvdisasm() -> str:
    import triton
    p = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    return str(p) if p.exists() else (shutil.which("nvdisasm") or "nvdisasm")


def counts(cubin: Path) -> collections.Counter:
    proc = subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {cubin}: {proc.stderr.strip()[:300]}")
    ops = collections.Counter()
    for line in proc.stdout.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("cache", type=Path)
    p.add_argument("--kernel", nargs="*", default=[])
    p.add_argument("--ops", nargs="*", default=["I2F.S8", "I2F.S16", "I2FP.F32.S32", "F2FP.BF16.F32.PACK_AB", "PRMT",
                                                  "LOP3.LUT", "IADD3", "VIADD", "FADD", "FFMA", "HADD2.BF16_V2",
                                                  "HFMA2.BF16_V2", "HMMA.16816.F32.BF16", "LDG.E.128", "LDGSTS.E.BYPASS.128"])
    a = p.parse_args()
    for cubin in sorted(a.cache.rglob("*.cubin")):
        name = cubin.stem
        if a.kernel and name not in a.kernel:
            continue
        meta = cubin.with_suffix(".json")
        md = {}
        if meta.exists():
            try:
                md = json.loads(meta.read_text())
            except (OSError, ValueError):
                md = {}
        ops = counts(cubin)
        sel = {o: ops[o] for o in a.ops if ops.get(o)}
        print(json.dumps(dict(kernel=name, total=sum(ops.values()), ops=sel, warps=md.get("num_warps"),
                              stages=md.get("num_stages"), dir=os.path.basename(cubin.parent))))


if __name__ == "__main__":
    main()
