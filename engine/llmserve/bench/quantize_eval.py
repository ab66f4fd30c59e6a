"""``llmserve quantize-eval``: size, quality and matched decode throughput of each weight mode.

Modes (``MODES``): ``fp16`` is the unquantized 16-bit baseline *in the selected dtype* (on CPU
the default dtype is float32 and the report says so in ``compute_dtype``); ``int8`` and
``int4`` are the reference dequantize-then-matmul layers; ``triton-int8`` is the fused Triton
kernel (CUDA, or Triton's CPU interpreter when ``TRITON_INTERPRET=1``). See
:mod:`llmserve.quant` for the formats.

Per mode the report holds: stored bytes (params + persistent buffers) and their ratio to the
baseline; strided perplexity on one token stream; HellaSwag accuracy (or ``null`` with the
reason); KL(p16 || pq), top-1 agreement and max/mean absolute logit error against the baseline
on exactly the perplexity's scored positions; greedy output tok/s on one fixed workload
(same prompts, prompt/output lengths, batch size, ``ignore_eos``) through ``LLMEngine``; and
``status`` ``ok`` | ``failed`` with every stage's error. A failing mode stays in the report as
a failed row with whatever it did measure; it is never dropped.

Two phases keep peak memory at "baseline + one quantized copy (+ one KV cache)": quality for
every mode (the baseline stays loaded as the KL reference; each quantized copy shares the
baseline's embeddings/norms), then throughput for every mode (one engine at a time; the engine
is handed the quantized model rebuilt exactly as the quality phase built it, so int4's group
size matches; the engine's own ``linear_backend`` stays ``torch``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..quant import DEFAULT_INCLUDE, model_nbytes, quantized_copy

MODES = ("fp16", "int8", "int4", "triton-int8")
MODE_SCHEMES: dict[str, str | None] = {"fp16": None, "int8": "int8", "int4": "int4",
                                       "triton-int8": "triton-int8"}
SCHEMA = "llmserve.bench.quantize_eval/v1"

CSV_COLUMNS = [
    "mode", "status", "scheme", "compute_dtype", "group_size", "quantized_modules",
    "stored_bytes", "resident_bytes", "bytes_ratio", "perplexity", "nll_mean",
    "ppl_scored_tokens", "hellaswag_acc", "hellaswag_acc_sum", "hellaswag_samples",
    "hellaswag_reason", "kl_mean", "kl_max", "top1_agreement", "max_abs_logit_error",
    "mean_abs_logit_error", "compared_positions", "throughput_tok_s", "throughput_output_tokens",
    "throughput_elapsed_s", "greedy_agreement_vs_fp16", "quality_s", "error",
]


@dataclass(frozen=True)
class QuantEvalSettings:
    """What to measure; validated on construction (``ValueError`` names the field).

    Attributes:
        modes: subset of :data:`MODES`, in report order.
        eval_tokens: tokens of the perplexity / KL stream (>= 2).
        window, stride: strided perplexity (see :func:`llmserve.bench.evaluation.iter_windows`).
        group_size: int4 group size (``None`` = per output channel); int8 is per channel.
        include: regex of the module names to quantize (``None`` = decoder projections).
        hellaswag_samples: items to score (0 = skip).
        throughput_requests: requests of the matched workload (0 = skip throughput).
        throughput_batch_size: the engine's ``max_num_seqs`` in every mode.
        throughput_prompt_len, throughput_output_len: fixed tokens per request.
    """

    modes: tuple[str, ...] = MODES
    eval_tokens: int = 2048
    window: int = 1024
    stride: int = 512
    group_size: int | None = 128
    include: str | None = None
    hellaswag_samples: int = 0
    throughput_requests: int = 8
    throughput_batch_size: int = 8
    throughput_prompt_len: int = 64
    throughput_output_len: int = 32

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be a non-empty subset of {list(MODES)}, got {list(self.modes)}")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must not repeat, got {list(self.modes)}")
        if self.eval_tokens < 2:
            raise ValueError(f"eval_tokens must be >= 2, got {self.eval_tokens}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")
        if not 1 <= self.stride <= self.window:
            raise ValueError(f"stride must be in [1, window={self.window}], got {self.stride}")
        for name in ("hellaswag_samples", "throughput_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("throughput_batch_size", "throughput_prompt_len", "throughput_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"group_size must be an even integer >= 2 or None, got {self.group_size}")


# ----------------------------------------------------------------------------------------------
# Per-mode pieces (module-level so tests can monkeypatch one of them)
# ----------------------------------------------------------------------------------------------

def build_mode_model(baseline: torch.nn.Module, mode: str, settings: QuantEvalSettings) -> torch.nn.Module:
    """The model of ``mode``: the baseline itself for ``fp16``, else a quantized copy sharing
    the baseline's unquantized tensors (:func:`llmserve.quant.quantized_copy`)."""
    scheme = MODE_SCHEMES[mode]
    if scheme is None:
        return baseline
    return quantized_copy(baseline, scheme, group_size=settings.group_size if scheme == "int4" else None,
                          include=settings.include)


def _err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) <= 2000 else msg[:2000] + " ..."


def _free(collect: bool = True) -> None:
    """Release memory between modes: ``gc.collect`` (engines may hold reference cycles; a full
    collection costs ~0.1-0.5 s, so the quality phase, whose models have no cycles, skips it)
    and the CUDA caching allocator's free blocks."""
    if collect:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _new_row(mode: str, dtype_name: str, settings: QuantEvalSettings) -> dict[str, Any]:
    scheme = MODE_SCHEMES[mode]
    row: dict[str, Any] = {c: None for c in CSV_COLUMNS}
    row.update({
        "mode": mode, "status": "ok", "scheme": scheme or "none (16-bit baseline)",
        "compute_dtype": dtype_name,
        "group_size": settings.group_size if scheme == "int4" else None,
        "errors": {},
    })
    if scheme is None:
        row["label"] = f"unquantized baseline in {dtype_name}"
    return row


def _finish_row(row: dict[str, Any]) -> None:
    errors = row["errors"]
    row["status"] = "failed" if errors else "ok"
    row["error"] = "; ".join(f"{k}: {v}" for k, v in errors.items()) if errors else None


def evaluate_quality(baseline: torch.nn.Module, tokens: list[int], settings: QuantEvalSettings,
                     dtype_name: str, tokenizer: Any = None,
                     hellaswag_items: list | None = None, hellaswag_reason: str | None = None
                     ) -> list[dict[str, Any]]:
    """Phase 1: size, perplexity, HellaSwag and error vs the baseline for every mode.

    Args:
        baseline: the 16-bit model (also the KL reference).
        tokens: the evaluation stream.
        hellaswag_items: items to score (``None``: HellaSwag is ``null`` with
            ``hellaswag_reason``).

    Returns:
        One row per mode in ``settings.modes`` order, failures included. Each quantized model
        is freed before the next is built.
    """
    from .evaluation import evaluate_language_modeling, score_hellaswag

    base_bytes = model_nbytes(baseline)
    rows: list[dict[str, Any]] = []
    for mode in settings.modes:
        row = _new_row(mode, dtype_name, settings)
        rows.append(row)
        t0 = time.perf_counter()
        try:
            model = build_mode_model(baseline, mode, settings)
        except Exception as e:  # noqa: BLE001 - a failed mode is a row, not a crash
            row["errors"]["quantize"] = _err(e)
            row["traceback"] = traceback.format_exc(limit=8)
            _finish_row(row)
            _free(collect=False)
            continue
        meta = getattr(model, "quantization_config", None)
        row["quantized_modules"] = len(meta["modules"]) if meta else 0
        row["stored_bytes"] = model_nbytes(model)
        row["resident_bytes"] = model_nbytes(model, include_non_persistent=True)
        row["bytes_ratio"] = row["stored_bytes"] / base_bytes if base_bytes else None
        try:
            lm = evaluate_language_modeling(model, tokens, settings.window, settings.stride,
                                            reference=baseline)
            row.update({"perplexity": lm.perplexity, "nll_mean": lm.nll_mean,
                        "ppl_scored_tokens": lm.num_scored_tokens})
            row.update(lm.comparison or {})
        except Exception as e:  # noqa: BLE001
            row["errors"]["quality"] = _err(e)
            row["traceback"] = traceback.format_exc(limit=8)
        if hellaswag_items is None:
            row["hellaswag_reason"] = hellaswag_reason or "not requested"
        else:
            try:
                hs = score_hellaswag(model, tokenizer, hellaswag_items)
                row.update({"hellaswag_acc": hs["acc"], "hellaswag_acc_sum": hs["acc_sum"],
                            "hellaswag_samples": hs["num_items"]})
            except Exception as e:  # noqa: BLE001
                row["errors"]["hellaswag"] = _err(e)
                row["hellaswag_reason"] = "failed: " + _err(e)
        row["quality_s"] = time.perf_counter() - t0
        _finish_row(row)
        del model
        _free(collect=False)
    return rows


def throughput_prompts(tokens: list[int], num_requests: int, prompt_len: int) -> list[list[int]]:
    """``num_requests`` prompts of exactly ``prompt_len`` ids, consecutive slices of ``tokens``
    (wrapping around; the stream is tiled if shorter than one prompt)."""
    if not tokens:
        raise ValueError("need a non-empty token stream to build prompts")
    stream = list(tokens)
    while len(stream) < prompt_len + 1:
        stream = stream + list(tokens)
    span = len(stream) - prompt_len
    return [stream[(i * prompt_len) % span:(i * prompt_len) % span + prompt_len] for i in range(num_requests)]


def make_engine_for_model(model: torch.nn.Module, model_config: Any, model_path: Path | None,
                          model_name: str, device: str, dtype_name: str, seed: int,
                          settings: QuantEvalSettings, attention_backend: str = "torch") -> Any:
    """An ``LLMEngine`` around an already built (possibly quantized) model, with the matched
    scheduler config: continuous batching, ``max_num_seqs = throughput_batch_size``, a token
    budget that prefills a whole batch in one step, no chunking. The engine's own
    ``linear_backend`` is ``torch`` because the model arrives quantized."""
    from ..engine.llm_engine import LLMEngine
    from ..engine_args import EngineArgs

    s = settings
    cfg = EngineArgs(
        model=model_name, device=device, dtype=dtype_name, seed=seed, attention_backend=attention_backend,
        linear_backend="torch", max_num_seqs=s.throughput_batch_size, prefill_chunk_size=0,
        max_num_batched_tokens=max(s.throughput_batch_size * s.throughput_prompt_len,
                                   s.throughput_prompt_len + s.throughput_output_len),
        max_model_len=max(2, s.throughput_prompt_len + s.throughput_output_len)).create_engine_config()

    def _loader(name, device=None, dtype=None, attention_backend=None):
        return model, model_config, model_path

    return LLMEngine(cfg, load_model_fn=_loader)


def evaluate_throughput(rows: list[dict[str, Any]], baseline: torch.nn.Module,
                        prompts: list[list[int]], settings: QuantEvalSettings,
                        engine_factory: Callable[[torch.nn.Module], Any],
                        device: str = "cpu") -> None:
    """Phase 2: the matched greedy workload on every mode's model; fills the ``throughput_*``
    and ``greedy_agreement_vs_fp16`` fields of ``rows`` in place (errors go to
    ``errors["throughput"]``). Each mode's model is rebuilt with :func:`build_mode_model`
    (round-to-nearest is deterministic, so it is the model phase 1 measured) and handed to
    ``engine_factory``; one engine exists at a time."""
    from .evaluation import decode_throughput, token_agreement

    baseline_outputs = None
    for row in rows:
        mode = row["mode"]
        if "quantize" in row["errors"]:
            row["errors"]["throughput"] = "not run: the mode's model could not be built"
            _finish_row(row)
            continue
        engine = model = None
        try:
            model = build_mode_model(baseline, mode, settings)
            engine = engine_factory(model)
            res = decode_throughput(engine, prompts, settings.throughput_output_len, device=device)
            row.update({"throughput_tok_s": res["output_tok_s"],
                        "throughput_output_tokens": res["output_tokens"],
                        "throughput_elapsed_s": res["elapsed_s"]})
            if not res["all_full_length"]:
                row["errors"]["throughput"] = (f"some requests produced fewer than "
                                               f"{settings.throughput_output_len} tokens")
            if mode == "fp16":
                baseline_outputs = res["outputs"]
            elif baseline_outputs is not None:
                row["greedy_agreement_vs_fp16"] = token_agreement(baseline_outputs, res["outputs"])
        except Exception as e:  # noqa: BLE001
            row["errors"]["throughput"] = _err(e)
            row.setdefault("traceback", traceback.format_exc(limit=8))
        finally:
            del engine, model
            _free()
        _finish_row(row)


# ----------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------

def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda, "llmserve": __version__}
    for name in ("triton", "transformers", "numpy", "safetensors"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def _device_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"requested": device, "platform": platform.platform(),
                            "machine": platform.machine(), "processor": platform.processor() or None,
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda") and torch.cuda.is_available():
        d = torch.device(device)
        idx = d.index if d.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        info.update({"gpu_name": p.name, "gpu_capability": f"{p.major}.{p.minor}",
                     "gpu_memory_bytes": p.total_memory})
    return info


def _source_revision() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False)
        if rev.returncode == 0:
            return {"git_commit": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except Exception:  # noqa: BLE001
        pass
    return {"git_commit": None, "dirty": None}


def _model_info(name: str, path: Path | None, model_config: Any, model: torch.nn.Module) -> dict[str, Any]:
    info: dict[str, Any] = {"name": name, "path": str(path) if path else None}
    revision = None
    random_weights: bool | None = None
    if path is not None:
        parts = Path(path).parts
        if "snapshots" in parts and parts.index("snapshots") + 1 < len(parts):
            revision = parts[parts.index("snapshots") + 1]
        cfg_file = Path(path) / "config.json"
        if cfg_file.is_file():
            raw = cfg_file.read_bytes()
            info["config_sha256"] = hashlib.sha256(raw).hexdigest()
            try:
                if "llmserve_tiny" in json.loads(raw):
                    random_weights = True
            except ValueError:
                pass
        info["weight_files"] = {p.name: p.stat().st_size for p in sorted(Path(path).glob("*.safetensors"))}
    if name == "tiny":
        random_weights = True
    info["hub_revision"] = revision
    info["random_weights"] = random_weights
    if model_config is not None and dataclasses.is_dataclass(model_config):
        info["config"] = {k: getattr(model_config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")}
    info["num_parameters"] = sum(p.numel() for p in model.parameters())
    return info


def _note(model_info: dict[str, Any], dtype_name: str, settings: QuantEvalSettings,
          text_info: dict[str, Any]) -> str:
    parts = []
    if model_info.get("random_weights"):
        parts.append(f"Model {model_info['name']!r} has RANDOM weights: its perplexity and HellaSwag "
                     "accuracy mean nothing about language quality; this run only exercises the "
                     "code path.")
    else:
        parts.append(f"Model {model_info['name']!r}. If its weights are random (e.g. a benchmark "
                     "checkpoint with real shapes), perplexity and HellaSwag mean nothing.")
    parts.append("KL(p16 || pq), top-1 agreement and logit errors against the unquantized "
                 "baseline measure quantization error for any weights.")
    parts.append(f"Mode 'fp16' is the unquantized baseline in {dtype_name}.")
    parts.append(f"Perplexity: {settings.eval_tokens} tokens of {text_info.get('source')} "
                 f"(window {settings.window}, stride {settings.stride}); a narrow check, not a "
                 "general quality evaluation.")
    parts.append("Quantization is round-to-nearest weight-only (not GPTQ/AWQ); int8/int4 are "
                 "reference layers that dequantize before the matmul, so they are not expected "
                 "to be faster than the baseline.")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------

def run_quantize_eval(model_name: str = "tiny", device: str = "cpu", dtype: str | None = None,
                      settings: QuantEvalSettings | None = None, text_source: str = "auto",
                      text_file: str | None = None, text_split: str = "test",
                      hellaswag_file: str | None = None, attention_backend: str = "torch",
                      seed: int = 0) -> dict[str, Any]:
    """Load the model, build the evaluation data, measure every mode; return the report dict.

    Raises:
        ValueError / FileNotFoundError: bad settings, model or text source (before any mode
            runs). Failures inside a mode become failed rows instead.
    """
    from ..config import resolve_dtype
    from .evaluation import eval_token_stream, load_hellaswag_hf, load_hellaswag_jsonl
    from ..models.loader import load_model
    from ..tokenizer import load_tokenizer

    settings = settings or QuantEvalSettings()
    from ..engine_args import default_dtype

    dtype_name = default_dtype(device, dtype)
    dtype_name = str(resolve_dtype(dtype_name)).replace("torch.", "")
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    baseline, model_config, model_path = load_model(model_name, device=device, dtype=dtype_name,
                                                    attention_backend=attention_backend)
    baseline.eval()
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and settings.window > max_pos:
        raise ValueError(f"window ({settings.window}) exceeds the model's max_position_embeddings "
                         f"({max_pos}); pass --window <= {max_pos}")
    tokenizer = load_tokenizer(model_path)
    source = text_source
    if source == "auto":
        source = "file" if text_file else "sharegpt"
    try:
        tokens, text_info = eval_token_stream(tokenizer, settings.eval_tokens, source=source,
                                              text_file=text_file, split=text_split)
    except RuntimeError as e:                # e.g. wikitext without `datasets` / network
        raise ValueError(f"text source {source!r} is unavailable: {e}") from e

    hs_items, hs_reason, hs_info = None, None, {"source": None}
    if settings.hellaswag_samples == 0:
        hs_reason = "skipped (--hellaswag-samples 0)"
    else:
        try:
            if hellaswag_file:
                hs_items = load_hellaswag_jsonl(hellaswag_file, settings.hellaswag_samples)
                hs_info = {"source": "file", "path": str(hellaswag_file)}
            else:
                hs_items = load_hellaswag_hf(settings.hellaswag_samples)
                hs_info = {"source": "Rowan/hellaswag", "split": "validation"}
            hs_info["num_items"] = len(hs_items)
            hs_info["selection"] = f"first {len(hs_items)} items"
        except Exception as e:  # noqa: BLE001
            hs_items = None
            hs_reason = (f"no HellaSwag source ({_err(e)}); pass --hellaswag-file JSONL with "
                         "fields ctx, endings, label, or install `datasets` and run online")
            hs_info = {"source": None, "error": _err(e)}

    do_throughput = settings.throughput_requests > 0
    rows = evaluate_quality(baseline, tokens, settings, dtype_name, tokenizer=tokenizer,
                            hellaswag_items=hs_items, hellaswag_reason=hs_reason)
    prompts = None
    if do_throughput:
        prompts = throughput_prompts(tokens, settings.throughput_requests, settings.throughput_prompt_len)

        def factory(m):
            return make_engine_for_model(m, model_config, model_path, model_name, device, dtype_name,
                                         seed, settings, attention_backend)
        evaluate_throughput(rows, baseline, prompts, settings, factory, device=device)
    else:
        for row in rows:
            row["throughput_reason"] = "skipped (--throughput-requests 0)"

    model_info = _model_info(model_name, model_path, model_config, baseline)
    report = {
        "schema": SCHEMA,
        "created_unix": time.time(),
        "model": model_info,
        "device": _device_info(device),
        "versions": _versions(),
        "source_revision": _source_revision(),
        "baseline": {"mode": "fp16", "compute_dtype": dtype_name,
                     "stored_bytes": model_nbytes(baseline)},
        "settings": {**dataclasses.asdict(settings), "modes": list(settings.modes),
                     "include": settings.include or DEFAULT_INCLUDE,
                     "attention_backend": attention_backend, "seed": seed,
                     "throughput_workload": {
                         "requests": settings.throughput_requests,
                         "batch_size": settings.throughput_batch_size,
                         "prompt_len": settings.throughput_prompt_len,
                         "output_len": settings.throughput_output_len,
                         "sampling": "greedy, ignore_eos",
                         "metric": "output tokens / wall time of LLMEngine.generate (prefill "
                                   "included), after one untimed warm-up request",
                         "prompts": "consecutive slices of the evaluation token stream"}},
        "eval_text": text_info,
        "hellaswag": {**hs_info, "normalisation": "mean log-probability per ending token "
                      "(sum logprob / number of ending tokens); hellaswag_acc_sum is unnormalised"},
        "metrics": {
            "kl_mean": "mean over scored positions of KL(p_baseline || p_mode), nats, full vocabulary",
            "top1_agreement": "fraction of scored positions where argmax logits agree",
            "max_abs_logit_error / mean_abs_logit_error": "over scored positions x vocabulary, float32 logits",
            "stored_bytes": "parameters + persistent buffers, each tensor once",
            "bytes_ratio": "stored_bytes / baseline stored_bytes"},
        "note": _note(model_info, dtype_name, settings, text_info),
        "elapsed_s": time.perf_counter() - t_start,
        "modes": rows,
    }
    return report


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_report(report: dict[str, Any], json_path: str | Path, csv_path: str | Path | None = None
                 ) -> tuple[Path, Path]:
    """Write the JSON report and a one-row-per-mode CSV (default: the JSON path with ``.csv``)."""
    jp = Path(json_path)
    jp.parent.mkdir(parents=True, exist_ok=True)
    jp.write_text(json.dumps(_jsonable(report), indent=2) + "\n", encoding="utf-8")
    cp = Path(csv_path) if csv_path else jp.with_suffix(".csv")
    cp.parent.mkdir(parents=True, exist_ok=True)
    with open(cp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["model", *CSV_COLUMNS], extrasaction="ignore")
        w.writeheader()
        for row in report["modes"]:
            w.writerow({"model": report["model"]["name"], **_jsonable(row)})
    return jp, cp


def format_summary(report: dict[str, Any]) -> str:
    """A plain-text table of the rows (for the terminal)."""
    def f(v, spec, width):
        return f"{'-':>{width}}" if v is None else format(v, f">{width}{spec}")
    lines = [(f"model {report['model']['name']} on {report['device']['requested']} "
              f"(baseline {report['baseline']['compute_dtype']})"),
             (f"{'mode':<12} {'status':<7} {'MB':>9} {'ratio':>6} {'ppl':>10} {'KL':>9} "
              f"{'top1':>6} {'hellaswag':>9} {'tok/s':>8}")]
    for r in report["modes"]:
        mb = None if r["stored_bytes"] is None else r["stored_bytes"] / 1e6
        lines.append(f"{r['mode']:<12} {r['status']:<7} {f(mb, '.2f', 9)} "
                     f"{f(r['bytes_ratio'], '.3f', 6)} {f(r['perplexity'], '.4g', 10)} "
                     f"{f(r['kl_mean'], '.2e', 9)} {f(r['top1_agreement'], '.3f', 6)} "
                     f"{f(r['hellaswag_acc'], '.3f', 9)} {f(r['throughput_tok_s'], '.1f', 8)}")
        if r["error"]:
            lines.append(f"    error: {r['error'][:300]}")
    lines.append("note: " + report["note"])
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def add_quantize_eval_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``quantize-eval`` on an ``argparse`` subparsers object; returns the parser."""
    p = subparsers.add_parser(
        "quantize-eval", help="compare fp16/int8/int4/triton-int8: bytes, perplexity, HellaSwag, "
                              "KL vs 16-bit, matched decode throughput",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from ..engine_args import add_engine_args

    add_engine_args(p, only=("model", "device", "dtype", "seed", "attention_backend"), help_overrides={
        "attention_backend": "paged attention of the throughput engines: torch (default) or triton"})
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="tokens of the perplexity/KL stream")
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--stride", type=int, default=512, help="advance between windows (<= window)")
    p.add_argument("--text-source", default="auto", choices=["auto", "sharegpt", "wikitext", "file"],
                   help="auto: --text-file if given, else held-out ShareGPT text (offline)")
    p.add_argument("--text-file", default=None, help="local .txt / .jsonl (text) / .parquet (text column)")
    p.add_argument("--text-split", default="test", help="WikiText-2 split for --text-source wikitext")
    p.add_argument("--hellaswag-samples", type=int, default=0,
                   help="HellaSwag items to score (0 = skip; needs --hellaswag-file or `datasets` online)")
    p.add_argument("--hellaswag-file", default=None, help="JSONL with fields ctx, endings, label")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size (0 = per output channel)")
    p.add_argument("--include", default=None,
                   help=f"regex of module names to quantize (default {DEFAULT_INCLUDE!r})")
    p.add_argument("--throughput-requests", type=int, default=8, help="requests (0 = skip throughput)")
    p.add_argument("--throughput-batch-size", type=int, default=8, help="max_num_seqs in every mode")
    p.add_argument("--throughput-prompt-len", type=int, default=64)
    p.add_argument("--throughput-output-len", type=int, default=32)
    p.add_argument("--output", default="artifacts/quantization.json", help="report JSON path")
    p.add_argument("--csv", default=None, help="CSV path (default: the JSON path with .csv)")
    p.set_defaults(func=run_quantize_eval_cli)
    return p


def settings_from_args(args: argparse.Namespace) -> QuantEvalSettings:
    """Build validated settings from parsed CLI arguments."""
    modes = tuple(m.strip() for m in str(args.modes).split(",") if m.strip())
    if args.group_size < 0:
        raise ValueError(f"--group-size must be >= 0 (0 = per output channel), got {args.group_size}")
    return QuantEvalSettings(
        modes=modes, eval_tokens=args.eval_tokens, window=args.window, stride=args.stride,
        group_size=args.group_size or None, include=args.include,
        hellaswag_samples=args.hellaswag_samples, throughput_requests=args.throughput_requests,
        throughput_batch_size=args.throughput_batch_size,
        throughput_prompt_len=args.throughput_prompt_len,
        throughput_output_len=args.throughput_output_len)


def run_quantize_eval_cli(args: argparse.Namespace) -> int:
    """Run from parsed arguments; writes JSON + CSV and prints a summary. Returns 0 when the
    report was written (failed modes are rows in it), 1 if every mode failed."""
    settings = settings_from_args(args)
    report = run_quantize_eval(
        model_name=args.model, device=args.device, dtype=args.dtype, settings=settings,
        text_source=args.text_source, text_file=args.text_file, text_split=args.text_split,
        hellaswag_file=args.hellaswag_file, attention_backend=args.attention_backend or "torch",
        seed=args.seed or 0)
    jp, cp = write_report(report, args.output, args.csv)
    print(format_summary(report))
    print(f"wrote {jp} and {cp}", file=sys.stderr)
    return 0 if any(r["status"] == "ok" for r in report["modes"]) else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m llmserve.bench.quantize_eval``)."""
    parser = argparse.ArgumentParser(prog="llmserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_quantize_eval_subparser(sub)
    args = parser.parse_args(["quantize-eval", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
