"""Static checks of deploy/ (Docker, Grafana and k6 cannot run here) and of ``llmserve serve``.

* compose.yaml parses, has the engine / Prometheus / Grafana services and ports, and every file
  it mounts exists;
* prometheus.yml passes ``promtool check config``;
* the Grafana datasource and dashboard are consistent, every dashboard query names only
  ``llmserve:`` series that the app really exports, and every query is valid PromQL
  (``promtool check rules`` on the queries as recording rules);
* the k6 script passes ``node --check`` and, with stub k6 modules, its options and request
  draws match the benchmark profile;
* ``llmserve serve`` (a real subprocess) serves, and exits cleanly on SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from llmserve.serve.metrics import EXPORTED_METRICS, ServiceMetrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "llmserve.json"


def exported_series() -> set[str]:
    """Series names in a real exposition of the service's registry."""
    m = ServiceMetrics(lambda: {"num_running": 1, "num_waiting": 2, "kv_cache_usage": 0.5,
                                "num_free_blocks": 3, "num_total_blocks": 6, "num_preemptions": 4})
    t = m.tracker(5)
    t.on_output(None, 2)
    t.on_finish("length")
    m.on_rejected("queue_full")
    text = m.render()[0].decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_exported_metrics_list_matches_the_exposition():
    series = exported_series()
    for name in EXPORTED_METRICS:
        assert name in series or f"{name}_count" in series or f"{name}_bucket" in series, name
    required = ["llmserve:num_requests_running", "llmserve:num_requests_waiting", "llmserve:kv_cache_usage_perc",
                "llmserve:num_preemptions_total", "llmserve:prompt_tokens_total",
                "llmserve:generation_tokens_total", "llmserve:request_success_total"]
    hist = ["llmserve:time_to_first_token_seconds", "llmserve:inter_token_latency_seconds",
            "llmserve:request_time_per_output_token_seconds", "llmserve:e2e_request_latency_seconds",
            "llmserve:request_queue_time_seconds", "llmserve:request_prefill_time_seconds",
            "llmserve:request_decode_time_seconds", "llmserve:request_inference_time_seconds",
            "llmserve:request_num_preemptions"]
    assert all(n in series for n in required)
    assert all(f"{h}_bucket" in series and f"{h}_count" in series for h in hist)


# ---- compose -----------------------------------------------------------------------------------
def test_compose_file():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"engine", "prometheus", "grafana"} <= set(services)
    ports = {name: [str(p) for p in svc.get("ports", [])] for name, svc in services.items()}
    assert "8000:8000" in ports["engine"] and "9090:9090" in ports["prometheus"] and "3000:3000" in ports["grafana"]
    build = services["engine"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
    cmd = services["engine"]["command"]
    assert cmd[:2] == ["llmserve", "serve"] and "0.0.0.0" in cmd
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name} mounts missing {src}"
        for dep in svc.get("depends_on", []):
            assert dep in services
    prom_mounts = [v for v in services["prometheus"]["volumes"] if "prometheus.yml" in v]
    assert prom_mounts and prom_mounts[0].split(":")[1] == "/etc/prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


def test_dockerfile():
    lines = [ln.strip() for ln in (DEPLOY / "Dockerfile").read_text().splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    assert re.match(r"FROM python:3\.1[0-3]-slim", lines[0])
    text = "\n".join(lines)
    assert re.search(r'pip install .*"\.\[serve,structured\]"', text)
    assert "EXPOSE 8000" in text and "HEALTHCHECK" in text
    for ln in lines:
        if ln.startswith("COPY"):
            srcs = ln.split()[1:-1]
            assert all(any(ROOT.glob(src)) for src in srcs if "*" not in src), f"COPY source missing: {ln}"
    cmd = json.loads([ln for ln in lines if ln.startswith("CMD")][-1][3:].strip())
    assert cmd[:2] == ["llmserve", "serve"] and "0.0.0.0" in cmd


# ---- Prometheus --------------------------------------------------------------------------------
def test_prometheus_config():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "llmserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["engine:8000"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    p = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


# ---- Grafana -----------------------------------------------------------------------------------
def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_grafana_provisioning_and_dashboard():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    src = ds["datasources"][0]
    assert src["type"] == "prometheus" and src["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/llmserve.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    assert prov["providers"][0]["options"]["path"] in mounts  # the dashboards dir is mounted there
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == src["uid"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == src["uid"]


def test_dashboard_queries_use_exported_metrics():
    series = exported_series()
    exprs = dashboard_exprs()
    used = set()
    for title, expr in exprs:
        names = re.findall(r"llmserve:[A-Za-z0-9_:]+", expr)
        assert names, f"panel {title!r} queries no llmserve: metric"
        for n in names:
            assert n in series, f"panel {title!r} uses {n}, which the app does not export"
            used.add(n)
    text = " ".join(e for _, e in exprs)
    assert "rate(llmserve:generation_tokens_total" in text                       # throughput
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds"):    # TTFT / ITL percentiles
        assert re.search(rf"histogram_quantile\(0\.9[59], .*llmserve:{h}_bucket", text), h
    assert "llmserve:kv_cache_usage_perc" in used and "llmserve:num_requests_waiting" in used


def test_dashboard_queries_are_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    rules = []
    for i, (_, expr) in enumerate(dashboard_exprs()):
        e = expr.replace("$__rate_interval", "1m").replace("$job", ".*")
        rules.append({"record": f"dashboard:query_{i}", "expr": e})
    f = tmp_path / "rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    p = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


# ---- k6 ----------------------------------------------------------------------------------------
K6_STUBS = {
    "k6/http": "export default { post() { throw new Error('no network in this check'); } };",
    "k6": "export function check() { return true; }",
    "k6/metrics": "export class Counter { add() {} } export class Trend { add() {} }",
}


def test_k6_script_syntax_and_profile(tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not installed: cannot syntax-check the k6 script")
    script = (DEPLOY / "loadtests" / "completions.js").read_text()
    p = subprocess.run([node, "--input-type=module", "--check"], input=script, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    # Run the init context under node with stub k6 modules and inspect what it would send.
    for mod, code in K6_STUBS.items():
        stub = tmp_path / (mod.replace("/", "_") + ".mjs")
        stub.write_text(code)
        script = script.replace(f"from '{mod}';", f"from '{stub.as_uri()}';")
    script = "globalThis.__ENV = {}; globalThis.open = () => '[]';\n" + script
    script += ("\nconsole.log(JSON.stringify({options, n: REQUESTS.length,"
               " plen: REQUESTS.map(r => r.prompt.split(' ').length), out: REQUESTS.map(r => r.max_tokens)}));\n")
    (tmp_path / "k6check.mjs").write_text(script)
    p = subprocess.run([node, str(tmp_path / "k6check.mjs")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    sc = info["options"]["scenarios"]["completions"]
    profile = yaml.safe_load((ROOT / "config" / "benchmark-sharegpt.yaml").read_text())
    assert sc["executor"] == "constant-arrival-rate" and sc["rate"] == profile["arrival"]["rate"]
    assert sc["timeUnit"] == "1s"
    lo, hi = profile["prompt_len"]["min"], profile["prompt_len"]["max"]
    assert all(lo <= n <= hi for n in info["plen"])
    lo, hi = profile["output_len"]["min"], profile["output_len"]["max"]
    assert all(lo <= n <= hi for n in info["out"])
    out = sorted(info["out"])
    assert 32 <= out[len(out) // 2] <= 96  # median about 64, as the profile describes


# ---- the CLI -----------------------------------------------------------------------------------
def test_serve_flags():
    from llmserve.serve.server import add_serve_subparser, run_serve_cli
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_subparser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["serve"])
    assert (a.model, a.host, a.port, a.func) == ("tiny", "127.0.0.1", 8000, run_serve_cli)
    a = parser.parse_args(["serve", "--model", "m", "--device", "cuda", "--dtype", "bf16", "--port", "9",
                           "--max-batch-size", "4", "--block-size", "32", "--num-blocks", "100",
                           "--paged-attention-backend", "triton", "--linear-backend", "int8",
                           "--max-waiting", "7", "--served-model-name", "x", "--shutdown-timeout", "2.5"])
    assert (a.max_num_seqs, a.block_size, a.num_blocks, a.max_waiting, a.shutdown_timeout) == (4, 32, 100, 7, 2.5)
    assert (a.attention_backend, a.linear_backend, a.served_model_name) == ("triton", "int8", "x")


def test_llmserve_serve_subprocess_serves_and_stops_on_sigterm(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from llmserve.cli import main; sys.exit(main())", "serve",
         "--port", str(port), "--num-blocks", "64", "--max-batch-size", "4", "--served-model-name", "tiny-cli",
         "--shutdown-timeout", "1", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-cli", "prompt": "Hi", "max_tokens": 3,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"] == "tiny-cli"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()  # graceful shutdown, exit status 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
