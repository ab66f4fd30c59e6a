"""The real lm-eval harness (``lm_eval==0.4.13``, ``--model local-completions``) against a real
uvicorn server on 127.0.0.1 serving the tiny model (CPU, fp32): a local ``multiple_choice``
task and a local ``loglikelihood_rolling`` task (JSONL files through ``dataset_path: json``).
The accuracy and perplexities in lm-eval's results JSON must equal those computed from the
engine's own logits (the readable path) for the same items and the same tokenization."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from conftest import tiny_server  # noqa: E402

MC_DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "label": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "label": 0},
    {"question": "Water freezes at", "choices": ["zero degrees", "ninety degrees", "noon"], "label": 0},
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Rome"], "label": 1},
    {"question": "Cats like to", "choices": ["sleep", "swim", "fly", "code"], "label": 2},
    {"question": "A year has", "choices": ["twelve months", "three days"], "label": 1},
]
PPL_DOCS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Inference engines batch requests to keep the accelerator busy."},
    {"text": "Hello world, this is a small perplexity check."},
]


@pytest.fixture(scope="module")
def server():
    with tiny_server(max_num_batched_tokens=64, prefill_chunk_size=8) as srv:
        yield srv


def _write_tasks(root: Path) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "ppl.jsonl").write_text("".join(json.dumps(d) + "\n" for d in PPL_DOCS))
    (root / "llmserve_mc.yaml").write_text(f"""task: llmserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
""")
    (root / "llmserve_ppl.yaml").write_text(f"""task: llmserve_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'ppl.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")


def _loglik(model, ids: list[int], ctxlen: int) -> float:
    """Sum of log p(ids[i] | ids[:i]) for i >= ctxlen, from the readable path's logits."""
    with torch.inference_mode():
        logits = model.forward_reference(torch.tensor([ids]))[0].float()       # [T, V]
    lp = torch.log_softmax(logits, dim=-1)
    return float(sum(lp[i - 1, ids[i]] for i in range(ctxlen, len(ids))))


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal-LM split: trailing context spaces move to the continuation, the whole
    string is encoded and cut after the context's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@pytest.mark.timeout(300)
def test_lm_eval_multiple_choice_and_rolling_match_engine_logits(server, tmp_path):
    _write_tasks(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                           f"tokenizer={server.checkpoint},num_concurrent=1,max_retries=1",
           "--tasks", "llmserve_mc,llmserve_ppl", "--include_path", str(tmp_path),
           "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results_file = sorted(out.rglob("results_*.json"))[-1]
    results = json.loads(results_file.read_text())["results"]

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(server.checkpoint))
    model = server.engine.engine.model

    correct = 0
    for d in MC_DOCS:
        lls = []
        for choice in d["choices"]:
            ctx, cont = _encode_pair(tok, d["question"], " " + choice)
            lls.append(_loglik(model, ctx + cont, len(ctx)))
        correct += int(max(range(len(lls)), key=lls.__getitem__) == d["label"])
    assert results["llmserve_mc"]["acc,none"] == pytest.approx(correct / len(MC_DOCS), abs=1e-12)

    total_ll, words, nbytes = 0.0, 0, 0
    eot = tok.eos_token_id
    for d in PPL_DOCS:
        ids = tok.encode(d["text"], add_special_tokens=False)
        total_ll += _loglik(model, [eot] + ids, 1)
        words += len(re.split(r"\s+", d["text"]))
        nbytes += len(d["text"].encode("utf-8"))
    ppl = results["llmserve_ppl"]
    assert ppl["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / words), rel=1e-4)
    assert ppl["byte_perplexity,none"] == pytest.approx(math.exp(-total_ll / nbytes), rel=1e-4)
    assert ppl["bits_per_byte,none"] == pytest.approx(-total_ll / nbytes / math.log(2), rel=1e-4)
