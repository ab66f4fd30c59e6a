"""Benchmark runner and reports: the submit loop, JSON schema, CSV rows, failed runs.

Most tests drive a small fake engine with the documented ``LLMEngine`` API so they run in
milliseconds; the last one runs ``llmserve benchmark`` end to end on the tiny model.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

import pytest
import yaml

from llmserve.bench import report as report_mod
from llmserve.bench import runner as runner_mod
from llmserve.bench.runner import BenchmarkOptions, run_benchmark
from llmserve.core.sequence import Sequence, SequenceStatus


class _Out:
    def __init__(self, seq, new):
        self.request_id = seq.request_id
        self.output_token_ids = list(seq.output_token_ids)
        self.new_token_ids = new
        self.finished = seq.is_finished
        self.finish_reason = seq.finish_reason
        self.metrics = seq.metrics


class FakeModelConfig:
    vocab_size = 1000
    num_hidden_layers = 2
    num_key_value_heads = 2
    head_dim = 8


class FakeEngine:
    """Documented engine API; every running sequence gets token ``(len(prompt) + i) % 1000``
    per step; at most ``max_num_seqs`` run; a request longer than ``max_model_len`` is rejected."""

    def __init__(self, config, naive=False, step_s=0.0005, fail_at_step=None):
        self.config = config
        self.naive = naive
        self.max_seqs = 1 if naive else config.scheduler.max_num_seqs
        self.max_model_len = config.scheduler.max_model_len
        self.block_size = config.cache.block_size
        self.model_config = FakeModelConfig()
        self.tokenizer = None
        self.waiting, self.running = [], []
        self.step_s, self.fail_at_step, self.num_steps = step_s, fail_at_step, 0
        self.max_blocks_in_use = 0

    def add_request(self, prompt, sampling_params, request_id=None, arrival_time=None, priority=0):
        if len(prompt) + sampling_params.max_tokens > self.max_model_len:
            raise ValueError("prompt + max_tokens exceeds the model's context")
        seq = Sequence(request_id, list(prompt), sampling_params, arrival_time=arrival_time,
                       priority=priority, eos_token_ids=(999,))
        self.waiting.append(seq)
        return seq

    def abort_request(self, request_id):
        return False

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def step(self):
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("CUDA out of memory (simulated)")
        while self.waiting and len(self.running) < self.max_seqs:
            s = self.waiting.pop(0)
            s.status = SequenceStatus.RUNNING
            s.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(s)
        for s in self.running:
            s.block_ids = list(range((s.num_tokens + self.block_size) // self.block_size))
        self.max_blocks_in_use = max(self.max_blocks_in_use, sum(len(s.block_ids) for s in self.running))
        time.sleep(self.step_s)
        outs = []
        for s in list(self.running):
            tok = (s.num_prompt_tokens + s.num_output_tokens) % 998
            s.append_token(tok)
            st = s.check_stop(self.max_model_len)
            if st is not None:
                s.status = st
                s.metrics.finish_time = time.perf_counter()
                s.block_ids = []
                self.running.remove(s)
            outs.append(_Out(s, [tok]))
        return outs

    def stats(self):
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_total_blocks": 4096, "kv_cache_usage": sum(len(s.block_ids) for s in self.running) / 4096,
                "block_size": self.block_size}


def _profile(tmp_path, n=6, rate=200.0, prompt=20, out=5, warmup=1):
    f = tmp_path / "prof.yaml"
    f.write_text(yaml.safe_dump({
        "name": "unit", "seed": 3, "num_requests": n, "warmup_requests": warmup,
        "arrival": {"rate": rate, "burstiness": 1.0}, "dataset": {"kind": "synthetic"},
        "prompt_len": {"distribution": "uniform", "min": prompt, "max": prompt * 2},
        "output_len": {"distribution": "uniform", "min": out, "max": out * 2},
        "ignore_eos": True}))
    return str(f)


def _opts(tmp_path, **kw):
    if "profile" not in kw:
        kw["profile"] = _profile(tmp_path)
    kw.setdefault("output", str(tmp_path / "run.json"))
    kw.setdefault("progress", False)
    return BenchmarkOptions(**kw)


def test_fake_run_writes_valid_report_and_csv(tmp_path):
    report, out, csv_path = run_benchmark(_opts(tmp_path, profile_components=True),
                                          engine_factory=lambda c, naive: FakeEngine(c, naive))
    assert report["status"] == "ok", report["error"]
    assert out == tmp_path / "run.json" and csv_path == tmp_path / "run.csv"
    data = json.loads(out.read_text())
    assert report_mod.validate_report(data) == []
    assert data["schema_version"] == report_mod.SCHEMA_VERSION
    agg = data["aggregates"]
    assert agg["num_requests"] == 6 and agg["num_completed"] == 6
    assert agg["total_output_tokens"] == sum(r["max_tokens"] for r in data["requests"])
    assert all(r["output_len"] == r["max_tokens"] and r["status"] == "ok" for r in data["requests"])
    assert agg["ttft_ms_p50"] > 0 and agg["tpot_ms_p50"] > 0 and agg["output_throughput"] > 0
    assert data["warmup"]["num_requests"] == 1
    assert data["warmup"]["kernel_warmup"] is None                 # the fake engine has none
    assert "triton_compiles_measured" in data["warmup"]
    assert data["seed"] == 3 and data["profile"]["name"] == "unit"
    assert data["engine_config"]["scheduler"]["max_num_seqs"] == 8
    assert len(data["token_digest"]) == 64 and len(data["workload"]["digest"]) == 64
    assert data["kv_cache"]["available"] and 0 < agg["kv_memory_reduction_vs_contiguous"] < 1
    assert data["gpu"]["available"] is False and "cpu" in data["gpu"]["reason"]
    host = data["host"]                                  # collector passes of the measured phase
    assert host["gc_collections"] >= 0 and host["gc_max_pause_ms"] <= host["gc_total_pause_ms"] + 1e-9
    assert host["step_seconds"] is None                  # the fake engine keeps no phase times
    assert data["versions"]["torch"] and data["hardware"]["cpu_count"]
    assert "hostname" not in json.dumps(data["hardware"]).lower()
    comp = data["component_profile"]
    assert comp["available"] and comp["components"]["engine_other"]["total_ms"] > 0
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 1 and list(rows[0]) == list(report_mod.CSV_COLUMNS)
    assert rows[0]["status"] == "ok" and rows[0]["config"] == "continuous"
    assert float(rows[0]["output_throughput"]) == pytest.approx(agg["output_throughput"])


def test_same_seed_same_tokens_and_csv_appends(tmp_path):
    kw = dict(engine_factory=lambda c, naive: FakeEngine(c, naive))
    r1, _, csv_path = run_benchmark(_opts(tmp_path, csv=str(tmp_path / "all.csv")), **kw)
    r2, _, _ = run_benchmark(_opts(tmp_path, csv=str(tmp_path / "all.csv"), config="static"), **kw)
    assert r1["token_digest"] == r2["token_digest"]
    assert r1["workload"]["digest"] == r2["workload"]["digest"]
    lines = csv_path.read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("created_at,status,")   # one header, two rows


def test_arrival_schedule_is_respected(tmp_path):
    prof = _profile(tmp_path, n=5, rate=20.0, warmup=0)
    report, _, _ = run_benchmark(_opts(tmp_path, profile=prof),
                                 engine_factory=lambda c, naive: FakeEngine(c, naive))
    offs = [r["arrival_offset_s"] for r in report["requests"]]
    assert offs[0] == 0 and offs == sorted(offs) and offs[-1] > 0.05
    assert report["aggregates"]["duration_s"] >= offs[-1]
    assert all(r["submit_lag_ms"] >= 0 for r in report["requests"])


def test_forced_failure_writes_failed_row(tmp_path):
    report, out, csv_path = run_benchmark(
        _opts(tmp_path), engine_factory=lambda c, naive: FakeEngine(c, naive, fail_at_step=4))
    assert report["status"] == "failed"
    assert "RuntimeError: CUDA out of memory" in report["error"]
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and report_mod.validate_report(data) == []
    assert data["aggregates"]["num_completed"] < data["aggregates"]["num_requests"]
    rows = list(csv.DictReader(csv_path.open()))
    assert rows[0]["status"] == "failed" and "out of memory" in rows[0]["error"]


def test_engine_construction_failure_and_exit_codes(tmp_path, monkeypatch):
    def boom(config, naive):
        raise RuntimeError("no weights here")

    monkeypatch.setattr(runner_mod, "default_engine_factory", boom)
    out = tmp_path / "x.json"
    base = ["--profile", _profile(tmp_path), "--output", str(out), "--no-progress"]
    assert runner_mod.main(base) == 0
    assert json.loads(out.read_text())["error"] == "RuntimeError: no weights here"
    assert runner_mod.main(base + ["--fail-on-error"]) == 1
    rows = list(csv.DictReader((tmp_path / "x.csv").open()))
    assert [r["status"] for r in rows] == ["failed", "failed"]


def test_timeout_fails_the_run(tmp_path):
    prof = _profile(tmp_path, n=4, rate=200.0, out=50, warmup=0)
    report, _, _ = run_benchmark(_opts(tmp_path, profile=prof, timeout=0.05),
                                 engine_factory=lambda c, naive: FakeEngine(c, naive, step_s=0.01))
    assert report["status"] == "failed" and report["error"].startswith("BenchmarkTimeout")
    assert any(r["status"] == "unfinished" for r in report["requests"])


def test_rejected_request_is_recorded_not_fatal(tmp_path):
    prof = _profile(tmp_path, n=4, prompt=40, out=5, warmup=0)
    report, _, _ = run_benchmark(_opts(tmp_path, profile=prof, max_model_len=70),
                                 engine_factory=lambda c, naive: FakeEngine(c, naive))
    assert report["status"] == "ok"
    st = [r["status"] for r in report["requests"]]
    assert "rejected" in st and "ok" in st
    rej = next(r for r in report["requests"] if r["status"] == "rejected")
    assert "exceeds" in rej["error"]
    assert report["aggregates"]["num_failed"] == st.count("rejected")


def test_configs_map_to_engine_configs(tmp_path):
    seen = {}

    def factory(c, naive):
        seen[(c.scheduler.mode, c.scheduler.max_num_seqs, naive)] = c
        return FakeEngine(c, naive)

    for cfg in ("naive", "paged", "static", "continuous"):
        r, _, _ = run_benchmark(_opts(tmp_path, config=cfg, max_num_seqs=4, prefill_chunk_size=16,
                                      output=str(tmp_path / f"{cfg}.json")), engine_factory=factory)
        assert r["status"] == "ok"
    assert set(seen) == {("continuous", 1, True), ("continuous", 1, False), ("static", 4, False),
                         ("continuous", 4, False)}
    c = seen[("static", 4, False)]
    assert c.scheduler.prefill_chunk_size == 16 and c.cache.block_size == 16
    naive_report = json.loads((tmp_path / "naive.json").read_text())
    assert naive_report["kv_cache"]["available"] is False and "naive" in naive_report["kv_cache"]["reason"]


def test_invalid_profile_is_a_failed_run(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prompt_len: {distribution: lognormal, min: 1, max: 4}\noutput_len: {distribution: fixed, value: 2}\n")
    report, _, _ = run_benchmark(_opts(tmp_path, profile=str(bad)),
                                 engine_factory=lambda c, naive: FakeEngine(c, naive))
    assert report["status"] == "failed" and "needs 'median'" in report["error"]


def test_cli_flags_parse():
    import argparse
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    runner_mod.add_benchmark_subparser(sub)
    a = p.parse_args(["benchmark", "--config", "paged", "--policy", "sjf", "--max-batch-size", "4",
                      "--prefill-chunk-size", "0", "--max-num-batched-tokens", "512", "--block-size", "32",
                      "--num-blocks", "100", "--paged-attention-backend", "triton", "--linear-backend",
                      "int8", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--profile",
                      "lognormal", "--requests", "8", "--arrival-rate", "inf", "--seed", "5",
                      "--warmup-requests", "0", "--output", "x.json", "--csv", "y.csv",
                      "--profile-components", "--fail-on-error", "--timeout", "30",
                      "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--json-schema", "s.json"])
    o = runner_mod.options_from_args(a)
    assert o.config == "paged" and o.prefill_chunk_size == 0 and o.arrival_rate == float("inf")
    assert o.json_schema == "s.json"
    assert o.linear_backend == "int8" and o.slo_tpot_ms == 50 and o.fail_on_error
    assert a.func is runner_mod.run_benchmark_cli
    with pytest.raises(SystemExit):
        p.parse_args(["benchmark", "--config", "bogus"])


def test_report_schema_lists_are_consistent():
    from llmserve.bench.metrics import AGGREGATE_KEYS
    assert report_mod.REQUIRED_AGGREGATE_KEYS == AGGREGATE_KEYS
    assert set(AGGREGATE_KEYS) <= set(report_mod.CSV_COLUMNS)
    assert len(set(report_mod.REQUIRED_FIELDS)) == len(report_mod.REQUIRED_FIELDS)
    probs = report_mod.validate_report({"status": "failed", "aggregates": {}, "requests": []})
    assert any("schema_version" in p for p in probs) and any("error text" in p for p in probs)
    assert report_mod.token_digest([[1, 2], [], [3]]) == report_mod.token_digest([[1, 2], None, [3]])
    assert report_mod.token_digest([[1, 2], [3]]) != report_mod.token_digest([[1], [2, 3]])


# ---- end to end on the real tiny model -------------------------------------------------------
def _engine_available() -> bool:
    try:
        import llmserve.engine.llm_engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _engine_available(), reason="llmserve.engine.llm_engine is not importable yet")
def test_cli_smoke_tiny_model(tmp_path):
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, "-m", "llmserve.cli", "benchmark", "--config", "continuous",
           "--requests", "8", "--arrival-rate", "20", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["status"] == "ok", data["error"]
    assert report_mod.validate_report(data) == []
    agg = data["aggregates"]
    assert agg["num_completed"] == 8 and agg["output_throughput"] > 0
    assert agg["ttft_ms_p95"] is not None and agg["tpot_ms_p95"] is not None
    assert data["profile"]["name"] == "sharegpt" and data["workload"]["arrival_rate"] == 20.0
    assert data["kv_cache"]["available"] and data["kv_cache"]["memory_reduction_vs_contiguous"] > 0
    rows = list(csv.DictReader((tmp_path / "smoke.csv").open()))
    assert rows[0]["status"] == "ok" and rows[0]["token_digest"] == data["token_digest"]
    # the engine's phase seconds of the measured steps only (reset after the warm-up request)
    st = data["host"]["step_seconds"]
    assert set(st) == {"schedule", "execute", "sample", "device_wait", "postprocess"}
    assert all(v >= 0 for v in st.values()) and st["execute"] > 0
    assert sum(st.values()) <= agg["duration_s"]


def test_stats_are_reset_through_the_public_method_after_warmup(tmp_path):
    """The runner resets an engine's counters with ``reset_stats()`` once the warm-up requests
    ran (no engine attribute is written from outside), before any measured step."""
    calls = []

    class Engine(FakeEngine):
        def reset_stats(self):
            calls.append((self.num_steps, len(self.waiting) + len(self.running)))
            self.max_blocks_in_use = 0

    rep, _, _ = run_benchmark(_opts(tmp_path), engine_factory=lambda c, naive: Engine(c, naive))
    assert rep["status"] == "ok", rep["error"]
    assert len(calls) == 1 and calls[0][0] > 0 and calls[0][1] == 0     # after warm-up, idle


def test_kernel_warmup_runs_before_the_warmup_requests(tmp_path):
    """An engine with ``warmup()`` is warmed up before the warm-up requests and its result
    lands in the report; ``--no-kernel-warmup`` skips it."""
    calls = []

    class WarmEngine(FakeEngine):
        def warmup(self):
            calls.append(self.num_steps)
            return {"seconds": 0.01, "requests": 3, "triton_compiles": 2}

    kw = dict(engine_factory=lambda c, naive: WarmEngine(c, naive))
    rep, _, _ = run_benchmark(_opts(tmp_path), **kw)
    assert rep["status"] == "ok" and calls == [0]
    assert rep["warmup"]["kernel_warmup"] == {"seconds": 0.01, "requests": 3, "triton_compiles": 2}
    rep, _, _ = run_benchmark(_opts(tmp_path, kernel_warmup=False), **kw)
    assert rep["status"] == "ok" and calls == [0] and rep["warmup"]["kernel_warmup"] is None
    import argparse
    p = argparse.ArgumentParser()
    runner_mod.add_benchmark_subparser(p.add_subparsers())
    assert runner_mod.options_from_args(p.parse_args(["benchmark", "--no-kernel-warmup"])).kernel_warmup is False
    assert runner_mod.options_from_args(p.parse_args(["benchmark"])).kernel_warmup is True


def test_triton_compiles_in_the_measured_phase_are_counted_and_named(tmp_path, monkeypatch):
    """The report counts and names the kernels added to Triton's cache during the measured
    phase only (a compile in the warm-up is not counted); a cache directory that does not
    exist yet reads as empty."""
    from llmserve.engine.triton_cache import triton_cache_entries, triton_kernel_names

    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert triton_cache_entries() == set()

    def fake_compile(key: str, name: str) -> None:
        (cache / key).mkdir(parents=True, exist_ok=True)
        (cache / key / f"{name}.json").write_text(json.dumps({"name": name}))

    class CompilingEngine(FakeEngine):
        def step(self):
            ids = {s.request_id for s in self.running + self.waiting}
            if any(r.startswith("warmup") for r in ids):
                fake_compile("w0", "_prefill_kernel")
            if any(r.startswith("bench") for r in ids):
                fake_compile("b0", "_decode_kernel")
                fake_compile("b1", "_gemv_kernel")
            return super().step()

    rep, _, _ = run_benchmark(_opts(tmp_path), engine_factory=lambda c, naive: CompilingEngine(c, naive))
    assert rep["status"] == "ok", rep["error"]
    assert rep["warmup"]["triton_compiles_measured"] == 2
    assert rep["warmup"]["triton_kernels_compiled_measured"] == ["_decode_kernel", "_gemv_kernel"]
    assert triton_cache_entries() == {"w0", "b0", "b1"}
    (cache / "odd").mkdir()
    assert triton_kernel_names({"odd", "w0"}) == ["?", "_prefill_kernel"]


def test_json_schema_option_constrains_every_request_and_is_recorded(tmp_path):
    """``--json-schema``: every request (warm-up included) follows the schema on the tiny model;
    the report records the schema, its digest and the engine's grammar counters; the token
    stream differs from the free run of the same seeded workload. A bad file is a failed run."""
    pytest.importorskip("xgrammar")
    schema = {"type": "array", "minItems": 50, "items": {"enum": ["x", "y"]}}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    prof = _profile(tmp_path, n=3, rate=float("inf"), prompt=8, out=6, warmup=1)
    free, _, _ = run_benchmark(_opts(tmp_path, profile=prof, output=str(tmp_path / "free.json")))
    rep, out, _ = run_benchmark(_opts(tmp_path, profile=prof, json_schema=str(f),
                                      output=str(tmp_path / "schema.json")))
    assert free["status"] == rep["status"] == "ok", rep["error"]
    data = json.loads(out.read_text())
    so = data["structured_output"]
    assert so["json_schema"] == schema and so["json_schema_path"] == str(f) and len(so["json_schema_sha256"]) == 64
    assert data["config"]["json_schema"] == str(f) and free["structured_output"] is None
    eng = so["engine"]
    assert eng["requests"] == 3 and eng["grammar_cache"]["compiles"] == 1     # counters of the measured phase
    assert eng["mask_rows"] == data["aggregates"]["total_output_tokens"]      # one bitmask row per token
    assert data["aggregates"]["total_output_tokens"] == free["aggregates"]["total_output_tokens"]
    assert data["token_digest"] != free["token_digest"]
    f.write_text("{not json")
    bad, _, _ = run_benchmark(_opts(tmp_path, profile=prof, json_schema=str(f), output=str(tmp_path / "bad.json")))
    assert bad["status"] == "failed" and "--json-schema" in bad["error"]
