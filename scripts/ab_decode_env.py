"""A/B of environment settings on batch-1 decode, one process, one GPU: the ``bench-compare``
decode measurement (median ms between tokens and one replay of the graph the steps used,
timed with CUDA events) for each setting; settings are interleaved over several rounds so
machine drift shows up as spread, not as a difference. Each setting is read when the engine
is built (a new engine per measurement).

Usage: python3 scripts/ab_decode_env.py OUT.json [--presets qwen2.5-1.5b ...] [--rounds 2]
          --settings "" "LLMSERVE_GRAPH_SHORT_CONTEXT=0" "LLMSERVE_PDL=0"
A setting is space-separated NAME=VALUE assignments ("" = the defaults). Settings that fail
(compile errors, anything raised) are kept as rows with the error. ``AB_LINEAR=triton-int8``
is not an environment variable: it builds that setting's engine with that linear backend
(``--linear-backend``).

Only variables read when an engine is built or a kernel is launched can be compared this way:
``LLMSERVE_GRAPH_SHORT_CONTEXT``, ``LLMSERVE_PDL``, ``LLMSERVE_ASYNC_SCHEDULING``,
``LLMSERVE_DECODE_GEMV``, ``LLMSERVE_DECODE_GEMV_MAX``, ``LLMSERVE_GEMV_CONFIG``,
``LLMSERVE_GEMV_TABLE``, ``LLMSERVE_GEMV_EARLY_EPILOGUE``, ``LLMSERVE_PDL_TRIGGER_FIRST``,
``LLMSERVE_GRAPH_ARGMAX``, ``LLMSERVE_GEMV_RED``, ``LLMSERVE_GEMV_PRE_WAIT``,
``LLMSERVE_GEMV_PRE_TILES``, ``LLMSERVE_PDL_TRIGGER_QKV``, ``LLMSERVE_PDL_FINAL_NORM``. Those read
once at import (``LLMSERVE_DECODE_SPLITS``, ``LLMSERVE_DECODE_STAGES``,
``LLMSERVE_DECODE_MIN_TILES``, ``LLMSERVE_DECODE_FUSED_MAX``) need one
process per setting.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from llmserve.bench_compare import decode_llmserve
from llmserve.benchmark.report import git_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow" / "scripts"))
from code_hash import code_hash


def provenance() -> dict:
    """Which code ran: the hash of the imported ``llmserve`` sources (the pipeline's code
    hash; the device copy of the tree has no git history) and the checkout's git state where
    there is one (``report.git_info``: revision, dirty, untracked)."""
    return {"code_hash": code_hash(), "git": git_info()}


def table_info(path: str | None) -> dict | None:
    """What a ``LLMSERVE_GEMV_TABLE`` file held: its sha256 and, for variants written by
    ``scripts/gemv_table_variant.py``, the entries it replaced (so a row can be reproduced
    without the file)."""
    if not path:
        return None
    try:
        raw = Path(path).read_bytes()
        overrides = json.loads(raw).get("overrides")
    except (OSError, ValueError, AttributeError) as e:
        return {"path": path, "error": f"{type(e).__name__}: {e}"[:200]}
    return {"path": path, "sha256": hashlib.sha256(raw).hexdigest(), "overrides": overrides}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--presets", nargs="+", default=["qwen2.5-1.5b"])
    ap.add_argument("--settings", nargs="+", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=256)
    args = ap.parse_args()
    parsed = [dict(kv.split("=", 1) for kv in s.split()) for s in args.settings]
    names = sorted({k for p in parsed for k in p} - {"AB_LINEAR"})
    base = {k: os.environ.get(k) for k in names}
    rows = []
    prov = provenance()
    for rnd in range(args.rounds):
        for preset in args.presets:
            for label, env in zip(args.settings, parsed):
                for k in names:                       # the defaults, then this setting
                    if base[k] is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = base[k]
                env = dict(env)
                linear = env.pop("AB_LINEAR", "torch")
                os.environ.update(env)
                row = dict(linear_backend=linear, round=rnd, preset=preset, setting=label or "defaults",
                           gemv_table=table_info(os.environ.get("LLMSERVE_GEMV_TABLE")))
                t0 = time.time()
                try:
                    r = decode_llmserve(preset, args.steps, linear_backend=linear)
                    row.update(step_ms=r["step_ms_median"], replay_ms=r["graph_replay_ms"],
                               short_context_replays=r.get("short_context_replays"),
                               weight_bytes=r["weight_bytes"], error=None)
                except Exception as e:  # noqa: BLE001 - a failed setting is a row too
                    row.update(step_ms=None, replay_ms=None, error=f"{type(e).__name__}: {e}"[:400])
                    torch.cuda.empty_cache()
                row["wall_s"] = time.time() - t0
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:
                    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               **prov, "settings": args.settings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
