"""Greedy tokens of batch-1 decode under environment settings, one process, one GPU: the same
random-weight Qwen2.5 preset and prompt for every setting, so a setting that changes only *how*
the decode kernels run (launch order, counters, tiling) must give the tokens of the default.

Usage: python3 scripts/token_parity_env.py OUT.json [--presets qwen2.5-1.5b ...] [--tokens 96]
          --settings "" "LLMSERVE_GEMV_TILE_FLAGS=1"
Each row: preset, setting, tokens, and whether they equal the first setting's tokens.
``AB_LINEAR=triton-int8`` in a setting builds that engine with that linear backend (not an
environment variable).
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--presets", nargs="+", default=["qwen2.5-1.5b"])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--settings", nargs="+", required=True)
    args = ap.parse_args()
    from llmserve.bench_compare import llmserve_engine
    from llmserve.sampling_params import SamplingParams

    rows = []
    for preset in args.presets:
        first = None
        for setting in args.settings:
            env = dict(kv.split("=", 1) for kv in setting.split())
            linear = env.pop("AB_LINEAR", "torch")
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            row = {"preset": preset, "setting": setting, "tokens": None, "same_as_first": None, "error": None}
            try:
                torch.manual_seed(0)
                eng = llmserve_engine(preset, max_num_seqs=8, max_model_len=2048, num_blocks=2048,
                                      linear_backend=linear)
                prompt = [(7 * i + 3) % 5000 + 100 for i in range(args.prompt_len)]
                out = eng.generate([prompt], SamplingParams(max_tokens=args.tokens, ignore_eos=True))[0]
                row["tokens"] = out.output_token_ids
                row["graph_steps"] = eng.runner.num_graph_steps
                del eng
            except Exception as e:  # noqa: BLE001 - kept as a row
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                gc.collect()
                torch.cuda.empty_cache()
            if first is None:
                first = row["tokens"]
            row["same_as_first"] = row["tokens"] is not None and row["tokens"] == first
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
            with open(args.out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
