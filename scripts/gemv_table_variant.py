"""Write a variant of the tuned gemv table (``triton_kernels/gemv_configs.json``) with some
entries replaced, for A/B runs: point ``LLMSERVE_GEMV_TABLE`` at the output (the table is
read per file, so one process can compare several; see ``scripts/ab_decode_env.py``).

Usage: python3 scripts/gemv_table_variant.py OUT.json [--gpu "NVIDIA H200"]
           "float|rmsnorm+glu|1|1536|8960=2,2048,4,1" "float|rmsnorm+rope|1|1536|1024=1,2048,4,1"
Each override is ``<int8|float>|<prologue>|<M>|<K>|<N>=block_n,block_k,num_warps,stages[,programs_per_sm[,red[,pre]]]``
(the key of :func:`llmserve.triton_kernels.gemv.table_key` without the GPU name); a value is
checked with :class:`~llmserve.triton_kernels.gemv.GemvConfig` before it is written.
"""
from __future__ import annotations

import argparse
import json

from llmserve.triton_kernels import gemv as gm


def write_variant(configs: dict, out, base=None, record=None):
    """Write the gemv table ``base`` (default: the packaged ``gemv_configs.json``) with the
    entries ``configs`` (full keys, GPU name included -> table values) replaced, to ``out``;
    the file records ``variant_of`` (the base) and ``overrides`` (``record``, default
    ``configs``), which ``ab_decode_env.py`` copies into its rows. Returns ``out``."""
    src = str(base or gm._DEFAULT_TABLE)
    with open(src) as f:
        data = json.load(f)
    data["configs"].update(configs)
    data["variant_of"] = src
    data["overrides"] = configs if record is None else record
    with open(out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--gpu", default="NVIDIA H200")
    args = ap.parse_args()
    configs = {}
    for item in args.overrides:
        key, _, value = item.partition("=")
        if not value or key.count("|") != 4:
            raise SystemExit(f"override must be 'kind|prologue|M|K|N=bn,bk,warps,stages[,pps[,red[,pre]]]', got {item!r}")
        try:
            vals = [int(v) for v in value.split(",")]
            gm.GemvConfig(*vals)                   # raises on a malformed configuration
        except (TypeError, ValueError) as e:
            raise SystemExit(f"bad configuration in {item!r} (want block_n,block_k,num_warps,stages"
                             f"[,programs_per_sm[,red[,pre]]], powers of two; pre 1-4): {e}") from None
        configs[f"{args.gpu}|{key}"] = vals
    write_variant(configs, args.out, record=args.overrides)
    print(f"wrote {args.out}: {len(args.overrides)} overrides")


if __name__ == "__main__":
    main()
