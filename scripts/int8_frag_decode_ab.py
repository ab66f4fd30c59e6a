#!/usr/bin/env python
"""Decode steps of 2..16 sequences with Triton INT8 projections, with and without the
MMA-fragment copy of the weights (``LLMSERVE_INT8_FRAGMENTS``), on one GPU.

For each setting an engine is built (``--linear-backend triton-int8``, random weights with the
preset's shapes, CUDA graphs); for each batch size B, B requests with ``--context``-token
prompts are added, a few steps run, and the CUDA graph the last step replayed is timed alone
(CUDA events around ``--replays`` back-to-back replays; median of 5 such timings): the decode
step's GPU time without the host. The greedy tokens of the B requests are recorded too.
Writes ``--out`` (JSON) and prints a table.

Usage: python3 scripts/int8_frag_decode_ab.py --preset qwen2.5-1.5b --batches 2 4 8 --out ab.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from llmserve.bench_compare import llmserve_engine
from llmserve.sampling_params import SamplingParams


def step_ms(graph, replays: int) -> float:
    """Median over 5 timings of ``replays`` back-to-back replays, ms per replay."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / replays)
    return sorted(times)[2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--settings", nargs="+", default=["0", "1"],
                    help="in order: LLMSERVE_INT8_FRAGMENTS values, or comma-separated NAME=VALUE "
                         "environment settings (e.g. LLMSERVE_INT8_FRAGMENTS=1,LLMSERVE_INT8_FRAG_PDL=0)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    def assignments(setting: str) -> dict[str, str]:
        if "=" not in setting:
            return {"LLMSERVE_INT8_FRAGMENTS": setting}
        return dict(a.split("=", 1) for a in setting.split(","))

    names = {k for st in args.settings for k in assignments(st)}
    for setting in args.settings:
        for k in names:
            os.environ.pop(k, None)
        os.environ.update(assignments(setting))
        t0 = time.time()
        try:
            eng = llmserve_engine(args.preset, max_num_seqs=max(args.batches), max_model_len=2048,
                                  num_blocks=4096, linear_backend="triton-int8")
        except Exception as ex:  # noqa: BLE001 - kept as a row
            rows.append(dict(setting=setting, error=f"{type(ex).__name__}: {ex}"[:300]))
            print(rows[-1], flush=True)
            continue
        fast = eng.runner.forward
        for b in args.batches:
            row = dict(setting=setting, batch=b, preset=args.preset, context=args.context,
                       int8_fragments=getattr(fast, "int8_fragments", None), frag_pdl=getattr(fast, "frag_pdl", None))
            try:
                for i in range(b):
                    eng.add_request(list(range(100 + 7 * i, 100 + 7 * i + args.context)),
                                    SamplingParams(max_tokens=12, ignore_eos=True))
                for _ in range(4):
                    eng.step()
                row["step_ms"] = step_ms(eng.runner.cuda_graphs.last_graph, args.replays)
                outs = []
                while eng.has_unfinished_requests():
                    outs += [o for o in eng.step() if o.finished]
                row["tokens"] = [list(o.output_token_ids) for o in sorted(outs, key=lambda o: o.request_id)]
            except Exception as ex:  # noqa: BLE001 - kept as a row
                row["error"] = f"{type(ex).__name__}: {ex}"[:300]
            row["fragments_in_use"] = bool(getattr(fast, "int8_fragments", False)) if fast else None
            rows.append(row)
            print(f"[{time.time() - t0:5.1f}s] fragments={setting} batch {b}: "
                  + (f"{row['step_ms']:.3f} ms/step" if "step_ms" in row else row.get("error", "")), flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command=" ".join(os.sys.argv))
    with open(args.out, "w") as f:
        json.dump(dict(**meta, rows=rows), f, indent=1)
    # each row of a later setting against the latest earlier row of the first setting with the
    # same batch size (with --settings 0 1 0 1: round by round)
    last = {}
    for r in rows:
        if "step_ms" not in r:
            continue
        if r["setting"] == args.settings[0]:
            last[r["batch"]] = r
        elif r["batch"] in last:
            b0 = last[r["batch"]]
            same = sum(t0 == t1 for t0, t1 in zip(b0["tokens"], r["tokens"]))
            print(f"batch {r['batch']}: {b0['step_ms']:.3f} -> {r['step_ms']:.3f} ms/step "
                  f"({r['step_ms'] / b0['step_ms']:.3f}x, setting {r['setting']}); identical greedy "
                  f"sequences {same}/{len(r['tokens'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
