"""The one-launch decode layer (``triton_kernels/decode_layer.py``) against the five-kernel
matrix-vector path, batch 1, on random weights with a preset's exact shapes (one GPU).

For each configuration: a CUDA graph of all the model's layers (distinct weights a layer, so
nothing stays in L2 from one layer to the next), replayed back to back, median per replay
divided by the layer count; then one eager pass with the kernel's global-timer stamps, giving
each stage's time (latest program to finish the stage minus latest to finish the barrier
before it) and each barrier's wait, medians over layers.

Usage: python3 scripts/bench_decode_layer.py OUT.json [--preset qwen2.5-1.5b] [--ctx 128]
          [--configs "WARPS=8 PPS=2 QKV=8,512 O=16,512 GU=8,512 DOWN=16,512" ...]
A configuration is space-separated ``NAME=VALUE`` pairs for the ``LLMSERVE_DECODE_LAYER_<NAME>``
variables (``""`` = the defaults). Failures are kept as rows with the error.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from llmserve.models.presets import preset_config
from llmserve.triton_kernels._launch import pdl_available
from llmserve.triton_kernels.decode_layer import DecodeLayerWeights, decode_layer
from llmserve.triton_kernels.gemv import gemv, gemv_qkv_rope
from llmserve.triton_kernels.paged_attention import paged_attention_decode
from llmserve.attention.metadata import AttentionMetadata

STAGES = ["qkv", "barrier1", "attention", "barrier2", "o", "barrier3", "gate_up", "barrier4", "down"]


def build(preset: str, ctx: int, page: int = 16):
    cfg = preset_config(preset)
    h, i, hq, hkv, d = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                        cfg.num_key_value_heads, cfg.head_dim)
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, s=0.02):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * s).to(dt)

    nblk = (ctx + page - 1) // page
    layers = []
    for _ in range(cfg.num_hidden_layers):
        w = DecodeLayerWeights(rnd((hq + 2 * hkv) * d, h), rnd((hq + 2 * hkv) * d), 1 + rnd(h, s=0.1),
                               rnd(h, hq * d), None, 1 + rnd(h, s=0.1), rnd(2 * i, h), rnd(h, i), None)
        kc = rnd(nblk + 1, page, hkv, d, s=1.0)
        layers.append((w, kc, rnd(nblk + 1, page, hkv, d, s=1.0)))
    bt = torch.randperm(nblk, device=dev, dtype=torch.int64).to(torch.int32)[None, :]
    pos = torch.tensor([ctx - 1], device=dev)
    slot = (bt[0, (ctx - 1) // page].long() * page + (ctx - 1) % page).view(1)
    meta = AttentionMetadata(slot, torch.tensor([0, 1], dtype=torch.int32, device=dev),
                             torch.tensor([ctx], dtype=torch.int32, device=dev), bt, 1, ctx, page, True)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = torch.arange(ctx + 1, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = f.cos().to(dev), f.sin().to(dev)
    return cfg, layers, meta, pos, cos, sin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=[""])
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    cfg, layers, meta, pos, cos, sin = build(args.preset, args.ctx)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps, scale = cfg.rms_norm_eps, d ** -0.5
    pdl = pdl_available(torch.device("cuda"))
    barriers = torch.zeros((len(layers), 2), dtype=torch.int32, device="cuda")
    r = torch.randn(1, cfg.hidden_size, device="cuda").to(torch.bfloat16)

    def five(x):
        for w, kc, vc in layers:
            q = gemv_qkv_rope(x, w.w_qkv, bias=w.b_qkv, norm_weight=w.ln1, eps=eps, positions=pos,
                              slot_mapping=meta.slot_mapping, cos=cos, sin=sin, k_cache=kc, v_cache=vc,
                              num_heads=hq, num_kv_heads=hkv, pdl=pdl)
            o = paged_attention_decode(q, kc, vc, meta, scale, pdl=pdl)
            gemv(o.reshape(1, -1), w.w_o, residual=x, out=x, pdl=pdl)
            act = gemv(x, w.w_gate_up, prologue="rmsnorm", glu=True, norm_weight=w.ln2, eps=eps, pdl=pdl)
            gemv(act, w.w_down, residual=x, out=x, pdl=pdl)

    def fused(x, stamps=None):
        for li, (w, kc, vc) in enumerate(layers):
            decode_layer(x, w, positions=pos, slot_mapping=meta.slot_mapping, cos=cos, sin=sin, k_cache=kc,
                         v_cache=vc, block_tables=meta.block_tables, context_lens=meta.context_lens,
                         max_context_len=meta.max_context_len, num_heads=hq, num_kv_heads=hkv, eps=eps,
                         scale=scale, barrier=barriers[li], pdl=pdl,
                         stamps=None if stamps is None else stamps[li])

    def graph_us(step) -> float:
        x = r.clone()
        for _ in range(2):
            step(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(x)
        times = []
        for _ in range(args.replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1000)
        return statistics.median(times) / len(layers)

    # parity of one layer stack, fused vs five kernels (same start, caches written by both)
    xa, xb = r.clone(), r.clone()
    five(xa)
    fused(xb)
    parity = float((xa.float() - xb.float()).abs().max() / xa.float().abs().max().clamp_min(1e-6))

    rows = [{"config": "five kernels", "layer_us": graph_us(five), "error": None}]
    print(json.dumps(rows[-1]), flush=True)
    names = [k for k in os.environ if k.startswith("LLMSERVE_DECODE_LAYER_")]
    for c in args.configs:
        for k in names:
            os.environ.pop(k, None)
        env = dict(kv.split("=", 1) for kv in c.split())
        for k, v in env.items():
            os.environ[f"LLMSERVE_DECODE_LAYER_{k}"] = v
        row = {"config": c or "defaults", "layer_us": None, "stages_us": None, "error": None}
        try:
            row["layer_us"] = graph_us(fused)
            stamps = torch.full((len(layers), 132 * 32, 10), -1, dtype=torch.int64, device="cuda")
            x = r.clone()
            fused(x, stamps)
            torch.cuda.synchronize()
            per = {s: [] for s in STAGES}
            for li in range(1, len(layers)):
                t = stamps[li]
                t = t[t[:, 0] >= 0].double()
                ends = t.max(0).values
                per["qkv"].append(ends[1] - t[:, 0].min())
                for j, s in enumerate(STAGES[1:], start=2):
                    per[s].append(ends[j] - ends[j - 1])
            row["programs"] = int((stamps[1][:, 0] >= 0).sum())
            row["stages_us"] = {s: round(statistics.median(v).item() / 1000, 2) for s, v in per.items()}
        except Exception as e:  # noqa: BLE001 - kept as a row
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
           "ctx": args.ctx, "batch": 1, "pdl": pdl, "parity_max_rel": parity,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
