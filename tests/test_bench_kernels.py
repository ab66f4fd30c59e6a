"""``llmserve bench-kernels``: the CPU smoke run in the Triton interpreter writes a complete
report; options are validated; the GPU directory name follows the slug rule."""

from __future__ import annotations

import json

import pytest
from llmserve.bench.kernels import KernelBenchOptions, decode_splits_used, gpu_slug
from llmserve.cli import build_parser, main


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert gpu_slug("AMD Instinct MI300X") == "amd-instinct-mi300x"


def test_registered_next_to_bench_compare():
    sub = build_parser()._subparsers._group_actions[0].choices
    assert "bench-compare" in sub and "bench-kernels" in sub
    args = build_parser().parse_args(["bench-kernels", "--device", "cpu", "--quick", "--output", "x"])
    assert args.quick and args.output == "x" and args.sweep


@pytest.mark.parametrize("kw, field", [
    (dict(device="cpu"), "--quick"),
    (dict(device="tpu", quick=True), "device"),
    (dict(device="cpu", quick=True, sweep_deadline=0), "sweep_deadline"),
    (dict(device="cpu", quick=True, workers=-1), "workers"),
    (dict(device="cpu", quick=True, skip=frozenset({"gemm"})), "skip"),
    (dict(device="cpu", quick=True, decode_splits="many"), "decode_splits"),
])
def test_options_validated(kw, field):
    with pytest.raises(ValueError, match=field):
        KernelBenchOptions(**kw)


def test_cpu_smoke_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "kernels"
    rc = main(["bench-kernels", "--device", "cpu", "--quick", "--output", str(out)])
    assert rc == 0, capsys.readouterr().out[-3000:]
    res = json.loads((out / "kernels.json").read_text())
    md = (out / "kernels.md").read_text()

    env = res["env"]
    assert env["device"] == "cpu" and env["quick"] is True
    assert env["command"].startswith("llmserve bench-kernels --device cpu --quick")
    assert env["decode_options"]["split_policy"] == "legacy"
    # parity: every kernel family checked, all within tolerance
    kernels = {r["kernel"] for r in res["parity"]}
    assert kernels == {"paged_attention", "int8_linear", "invariant_linear", "invariant_attention"}
    cases = " ".join(r["case"] for r in res["parity"])
    for part in ("decode", "prefill+chunk", "mixed", "fused_reduce", "dequant"):
        assert part in cases
    assert all(r["ok"] and r["rel_err"] < 2e-2 for r in res["parity"])
    # decode: Triton and the torch reference, with bandwidth, floor and ratio to it
    impls = {r["impl"] for r in res["decode"]}
    assert impls == {"triton", "torch_reference"}
    for r in res["decode"]:
        for key in ("us", "gbps", "frac_ref_bw", "frac_meas_bw", "bytes", "floor_us", "floor_meas_us", "x_floor"):
            assert key in r and r[key] >= 0, key
        assert r["x_floor"] == pytest.approx(r["us"] / r["floor_meas_us"])
    tri = next(r for r in res["decode"] if r["impl"] == "triton")
    assert tri["num_splits"] >= 1 and tri["split_policy"] == "legacy"
    assert any("us" in s for s in res["decode_sweep"])
    # prefill: Triton, torch reference and SDPA peer
    assert {r["impl"] for r in res["prefill"]} >= {"triton", "torch_reference"}
    # int8 vs the float GEMM, with floors
    assert {r["M"] for r in res["int8"]} == {1, 20}
    for r in res["int8"]:
        for key in ("int8_us", "cublas_bf16_us", "speedup", "int8_gbps", "int8_floor_us", "int8_x_floor"):
            assert r[key] > 0, key
    assert any("us" in s and s["ok"] for s in res["int8_sweep"])
    # the batch-invariant linear vs the float GEMM at its fixed configuration, and its sweep
    # scored per weight over every swept M
    assert {(r["weight"], r["M"]) for r in res["invariant"]} == {(w, m) for w in ("proj", "wide") for m in (1, 20)}
    for r in res["invariant"]:
        assert r["invariant_us"] > 0 and r["cublas_bf16_us"] > 0 and r["config"] == "16x16x16 w1 s1"
    assert any("us" in s and s["ok"] for s in res["invariant_sweep"])
    # each candidate's rows against the configured product of the same rows, bit for bit
    checked = [s for s in res["invariant_sweep"] if "us" in s]
    assert checked and all(isinstance(s["bitwise"], bool) for s in checked)
    assert "bit for bit against the configured product" in md
    assert "rows alone: same bits" in cases and "first sequence alone: same bits" in cases
    assert res["targets"] == {"parity": "all ok"}
    # the report says the timings mean nothing and carries every section
    assert "Smoke run" in md and "of no value" in md
    for head in ("## Parity", "## Decode paged attention", "## Prefill / chunk attention",
                 "## INT8 weight-only linear vs cuBLAS bf16", "## Batch-invariant linear vs cuBLAS bf16",
                 "Batch-invariant linear sweep, best 3", "## Targets"):
        assert head in md


def test_cpu_smoke_skips_sections(tmp_path):
    out = tmp_path / "k"
    assert main(["bench-kernels", "--device", "cpu", "--quick", "--no-sweep",
                 "--skip", "decode,int8,prefill,invariant", "--output", str(out)]) == 0
    res = json.loads((out / "kernels.json").read_text())
    assert res["parity"] and not res["decode"] and not res["int8"] and not res["prefill"]
    assert not res["invariant"]
    assert "## Decode paged attention" in (out / "kernels.md").read_text()


def test_decode_splits_follow_the_policy():
    # the report's split count: legacy ~4 programs per SM, waves whole waves; on CPU the
    # launcher's tile is 16 positions, so a context of 40 has 3 tiles
    legacy = dict(split_policy="legacy", stages=3, min_tiles=1, wide_tile=True)
    assert decode_splits_used(2, 2, 40, 32, 2, legacy) == 3
    assert decode_splits_used(2, 2, 40, 32, 2, dict(legacy, min_tiles=4)) == 1
    assert decode_splits_used(2, 2, 1, 32, 2, legacy) == 1


def test_invariant_sweep_scores_rank_fixed_configurations():
    """A configuration is scored over every swept M (one serves them all); one that failed or
    was wrong at some M is left out."""
    from llmserve.bench.kernels import invariant_sweep_scores

    sweep = [dict(weight="o", M=8, config="a", us=10.0, ok=True), dict(weight="o", M=2048, config="a", us=40.0, ok=True),
             dict(weight="o", M=8, config="b", us=20.0, ok=True), dict(weight="o", M=2048, config="b", us=20.0, ok=True),
             dict(weight="o", M=8, config="c", us=5.0, ok=False), dict(weight="o", M=2048, config="c", us=5.0, ok=True),
             dict(weight="o", M=8, config="d", error="out of resources")]
    scores = invariant_sweep_scores(sweep)
    assert [r["config"] for r in scores] == ["a", "b"]
    assert scores[0]["score"] == pytest.approx(2 ** 0.5) and scores[1]["score"] == pytest.approx(2 ** 0.5)
