"""The command line: one-line device errors on every subcommand, clean help text, vLLM flag
names with the old spellings as aliases, ``serve MODEL``, --torch-threads, and a real
``llmserve serve`` process: access log on by default, the API key enforced and never logged."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from llmserve.cli import build_parser, main, resolve_torch_threads

ENGINE_DIR = str(Path(__file__).resolve().parents[1] / "engine")
SUBCOMMANDS = {
    "generate": ["generate", "--prompt", "hi"],
    "benchmark": ["benchmark", "--requests", "1"],
    "serve": ["serve"],
    "quantize-eval": ["quantize-eval"],
    "bench-compare": ["bench-compare"],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_cuda_without_cuda_is_one_line_and_exit_2(name, capsys):
    argv = SUBCOMMANDS[name] + ([] if name == "bench-compare" else ["--device", "cuda"])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "CUDA is not available" in err and err.startswith(f"llmserve {name}: error:"), err


def test_help_has_no_rest_markup():
    parser = build_parser()
    texts = [parser.format_help()]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        texts.append(p.format_help())
        undocumented = [a.option_strings[0] for a in p._actions
                        if a.option_strings and not a.help and a.option_strings[0] != "-h"]
        if name in ("bench-compare", "serve", "generate"):
            assert not undocumented, (name, undocumented)
    for t in texts:
        assert "``" not in t and ":mod:" not in t and ":class:" not in t and ":func:" not in t, t[:400]


@pytest.mark.parametrize("argv,dest,value", [
    (["serve", "--max-batch-size", "3"], "max_num_seqs", 3),
    (["serve", "--max-num-seqs", "3"], "max_num_seqs", 3),
    (["serve", "--paged-attention-backend", "triton"], "attention_backend", "triton"),
    (["serve", "--attention-backend", "triton"], "attention_backend", "triton"),
    (["serve", "--prefill-chunk", "64"], "prefill_chunk_size", 64),
    (["serve", "--disable-uvicorn-access-log"], "access_log", False),
    (["serve", "--disable-access-log"], "access_log", False),
    (["serve"], "access_log", True),
    (["benchmark", "--max-batch-size", "4"], "max_num_seqs", 4),
    (["benchmark", "--max-num-seqs", "4"], "max_num_seqs", 4),
    (["benchmark", "--paged-attention-backend", "triton"], "attention_backend", "triton"),
    (["benchmark", "--attention-backend", "triton"], "attention_backend", "triton"),
    (["benchmark", "--out", "x.json"], "output", "x.json"),
    (["benchmark", "--prefill-chunk", "32"], "prefill_chunk_size", 32),
    (["bench-compare", "--out", "d"], "out", "d"),
    (["bench-compare", "--output", "d"], "out", "d"),
    (["bench-compare", "--prefill-chunk-size", "128"], "prefill_chunk", 128),
    (["bench-compare", "--prefill-chunk", "128"], "prefill_chunk", 128),
    (["generate", "--prompt", "x", "--paged-attention-backend", "triton"], "attention_backend", "triton"),
])
def test_flag_aliases(argv, dest, value):
    assert getattr(build_parser().parse_args(argv), dest) == value


def test_serve_model_positional_and_api_key_sources(tmp_path, monkeypatch):
    from llmserve.serve.server import _model_name, resolve_api_key

    p = build_parser()
    assert _model_name(p.parse_args(["serve", "tiny"])) == "tiny"
    assert _model_name(p.parse_args(["serve", "--model", "tiny"])) == "tiny"
    assert _model_name(p.parse_args(["serve"])) == "tiny"
    with pytest.raises(ValueError, match="given twice"):
        _model_name(p.parse_args(["serve", "a", "--model", "b"]))
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    assert resolve_api_key(p.parse_args(["serve"])) is None
    assert resolve_api_key(p.parse_args(["serve", "--api-key", "k1"])) == "k1"
    f = tmp_path / "key"
    f.write_text("k2\n")
    assert resolve_api_key(p.parse_args(["serve", "--api-key-file", str(f)])) == "k2"
    monkeypatch.setenv("LLMSERVE_API_KEY", "k3")
    assert resolve_api_key(p.parse_args(["serve"])) == "k3"
    assert resolve_api_key(p.parse_args(["serve", "--api-key", "k1"])) == "k1"
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key(p.parse_args(["serve", "--api-key", "a", "--api-key-file", str(f)]))
    f.write_text("")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(p.parse_args(["serve", "--api-key-file", str(f)]))
    monkeypatch.delenv("LLMSERVE_API_KEY")
    with pytest.raises(ValueError, match="needs an API key"):
        resolve_api_key(p.parse_args(["serve", "--api-key-protect-metrics"]))


def test_torch_threads_default_is_one_on_cpu_and_recorded():
    before = torch.get_num_threads()
    try:
        assert resolve_torch_threads("cpu", None) == 1
        assert resolve_torch_threads("cpu", 2) == 2
        from llmserve.bench.runner import options_from_args
        args = build_parser().parse_args(["benchmark", "--torch-threads", "1"])
        assert options_from_args(args).torch_threads == 1
    finally:
        torch.set_num_threads(before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_access_log_and_api_key_never_logged(tmp_path):
    key = "sk-cli-9d1e4f00aa"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": ENGINE_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "LLMSERVE_API_KEY": key}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "serve", "tiny", "--port", str(port),
                                 "--num-blocks", "64", "--max-model-len", "256", "--log-level", "debug"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        assert httpx.post(url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {key}x"}).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert '"POST /v1/completions HTTP/1.1" 401' in text and '"POST /v1/completions HTTP/1.1" 200' in text, \
        text[-3000:]
    assert key not in text


def test_serve_defaults_to_chunked_prefill_with_a_step_budget():
    """`llmserve serve` chunks prompts by default (vLLM V1's behaviour): on a CPU 64-token chunks
    in a budget of one chunk plus one token per sequence; 512 / 2048 on CUDA; 0 turns it off."""
    from llmserve.cli import build_parser
    from llmserve.engine_args import device_defaults
    from llmserve.serve.server import build_engine_config

    cfg = build_engine_config(build_parser().parse_args(["serve"]))
    assert cfg.scheduler.prefill_chunk_size == 64
    assert cfg.scheduler.max_num_batched_tokens == 64 + cfg.scheduler.max_num_seqs
    d = device_defaults("cuda", "server")
    assert (d.prefill_chunk_size, d.max_num_batched_tokens, d.max_num_seqs) == (512, 2048, 256)
    off = build_engine_config(build_parser().parse_args(["serve", "--prefill-chunk-size", "0"]))
    assert off.scheduler.prefill_chunk_size is None and off.scheduler.max_num_batched_tokens == 4096
    mine = build_engine_config(build_parser().parse_args(["serve", "--prefill-chunk-size", "256",
                                                          "--max-num-batched-tokens", "300"]))
    assert (mine.scheduler.prefill_chunk_size, mine.scheduler.max_num_batched_tokens) == (256, 300)


