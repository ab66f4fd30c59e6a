"""Seeded, deterministic benchmark workloads: arrival times, prompt and output lengths, prompts.

A *load profile* (a YAML file under ``config/benchmark-*.yaml`` or a built-in name) says how
requests arrive and how long they are; :func:`build_workload` turns a profile and a seed into a
:class:`Workload`, the list of :class:`BenchmarkRequest` the runner submits. The same profile,
seed, request count and tokenizer always give the identical workload (see
:meth:`Workload.digest`).

Arrivals (``arrival``): open-loop, gamma-distributed inter-arrival times with shape
``burstiness`` and mean ``1 / rate`` seconds, as vLLM's ``benchmark_serving.py``
(``theta = 1 / (rate * burstiness)``; burstiness 1 is a Poisson process, < 1 burstier, > 1 more
regular). The first request arrives at t = 0. ``rate: inf`` sends everything at t = 0 (offline).

Lengths (``prompt_len``, ``output_len``), in tokens, one of:
  * ``lognormal``: ``round(exp(N(ln median, sigma)))`` clipped to ``[min, max]``; median and
    sigma are those of the unclipped distribution (a right-skewed workload);
  * ``uniform``: integers uniform in ``[min, max]`` (inclusive);
  * ``fixed``: always ``value``;
  * ``dataset`` (ShareGPT only): the real length, clipped to ``[min, max]``. A prompt longer
    than ``max`` is truncated to its first ``max`` tokens; a prompt shorter than ``min`` is
    skipped; a reply's token count times ``scale`` (default 1; output lengths only) is rounded
    and clipped (a scale < 1 shortens outputs for slow models while keeping each request's
    relative length).

Prompts (``dataset.kind``): ``synthetic`` draws token ids uniformly from ``[0, vocab_size)``;
``sharegpt`` uses the first human turn of ShareGPT conversations (packaged copy or
``dataset.path``) in a seeded random order, tokenized with the engine's tokenizer.

Random streams: one :class:`numpy.random.SeedSequence` per purpose (arrivals, prompt lengths,
output lengths, token ids, dataset order, priorities), spawned from ``(seed, stream)``, so
changing one part of a profile does not reshuffle the others. ``stream`` 0 is the measured
workload, 1 the warm-up requests.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BenchmarkRequest", "Workload", "BUILTIN_PROFILES", "load_profile", "validate_profile",
           "build_workload", "sample_lengths", "arrival_offsets", "find_profile_path",
           "DEFAULT_PROFILE", "DEFAULT_VOCAB_SIZE"]

#: Qwen2 base vocabulary (ids >= 151643 are special tokens); the default synthetic id range.
DEFAULT_VOCAB_SIZE = 151_643
DEFAULT_PROFILE = "sharegpt"

LENGTH_DISTRIBUTIONS = ("lognormal", "uniform", "fixed", "dataset")
DATASET_KINDS = ("synthetic", "sharegpt")
_TOP_KEYS = {"name", "description", "seed", "num_requests", "warmup_requests", "arrival",
             "dataset", "prompt_len", "output_len", "ignore_eos", "temperature", "priorities"}
_ARRIVAL_KEYS = {"rate", "burstiness"}
_DATASET_KEYS = {"kind", "path"}
_LENGTH_KEYS = {"distribution", "median", "sigma", "min", "max", "value", "scale"}

#: Built-in profiles; ``config/benchmark-<name>.yaml`` hold the same content (a test checks).
BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "sharegpt": {
        "name": "sharegpt",
        "description": "ShareGPT V3 prompts (first human turn) at 4 req/s Poisson; prompt "
                       "truncated to 512 tokens, output = 1/4 of the reply's token count clipped "
                       "to [4, 128] (median about 64) so the tiny CPU model runs fast.",
        "seed": 0,
        "num_requests": 32,
        "warmup_requests": 1,
        "arrival": {"rate": 4.0, "burstiness": 1.0},
        "dataset": {"kind": "sharegpt", "path": None},
        "prompt_len": {"distribution": "dataset", "min": 4, "max": 512},
        "output_len": {"distribution": "dataset", "scale": 0.25, "min": 4, "max": 128},
        "ignore_eos": True,
        "temperature": 0.0,
        "priorities": [0],
    },
    "lognormal": {
        "name": "lognormal",
        "description": "Right-skewed synthetic workload: clipped log-normal prompt and output "
                       "lengths, random token ids, 4 req/s Poisson arrivals.",
        "seed": 0,
        "num_requests": 32,
        "warmup_requests": 1,
        "arrival": {"rate": 4.0, "burstiness": 1.0},
        "dataset": {"kind": "synthetic", "path": None},
        "prompt_len": {"distribution": "lognormal", "median": 256, "sigma": 0.7,
                       "min": 16, "max": 2048},
        "output_len": {"distribution": "lognormal", "median": 64, "sigma": 0.7,
                       "min": 4, "max": 512},
        "ignore_eos": True,
        "temperature": 0.0,
        "priorities": [0],
    },
    "offline-random": {
        "name": "offline-random",
        "description": "Offline throughput workload: 256 requests of random token ids, input "
                       "and output lengths uniform in [100, 1024], all at t = 0, ignore_eos.",
        "seed": 0,
        "num_requests": 256,
        "warmup_requests": 0,
        "arrival": {"rate": "inf", "burstiness": 1.0},
        "dataset": {"kind": "synthetic", "path": None},
        "prompt_len": {"distribution": "uniform", "min": 100, "max": 1024},
        "output_len": {"distribution": "uniform", "min": 100, "max": 1024},
        "ignore_eos": True,
        "temperature": 0.0,
        "priorities": [0],
    },
}


@dataclass(slots=True)
class BenchmarkRequest:
    """One request of a workload.

    Attributes:
        index: position in arrival order (0-based); also the request id suffix.
        arrival_offset_s: seconds after the benchmark start at which the request arrives.
        prompt_token_ids: the prompt as token ids (what the engine receives).
        prompt_len: ``len(prompt_token_ids)``, tokens.
        max_tokens: output tokens to generate (the target output length).
        ignore_eos: generate exactly ``max_tokens`` tokens, past EOS.
        priority: lower runs first under the ``priority`` policy.
        prompt_text: the source text for ShareGPT prompts (``None`` for synthetic ones).
        source_id: the ShareGPT conversation id, if any.
    """

    index: int
    arrival_offset_s: float
    prompt_token_ids: list[int]
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = True
    priority: int = 0
    prompt_text: str | None = None
    source_id: str | None = None

    def spec(self) -> dict[str, Any]:
        """The fields that define the request (for digests and records), without the text."""
        return {"index": self.index, "arrival_offset_s": round(float(self.arrival_offset_s), 9),
                "prompt_len": self.prompt_len, "max_tokens": self.max_tokens,
                "ignore_eos": self.ignore_eos, "priority": self.priority,
                "source_id": self.source_id}


@dataclass(slots=True)
class Workload:
    """A resolved workload: the requests plus what produced them."""

    name: str
    seed: int
    stream: int
    arrival_rate: float
    burstiness: float
    profile: dict[str, Any]
    requests: list[BenchmarkRequest] = field(default_factory=list)
    vocab_size: int | None = None

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def is_offline(self) -> bool:
        return math.isinf(self.arrival_rate)

    def digest(self) -> str:
        """sha256 over every request's spec and prompt token ids, in index order."""
        h = hashlib.sha256()
        for r in self.requests:
            h.update(json.dumps(r.spec(), sort_keys=True).encode())
            h.update(np.asarray(r.prompt_token_ids, dtype=np.int64).tobytes())
        return h.hexdigest()

    def summary(self) -> dict[str, Any]:
        """Counts and totals for the report (JSON-safe)."""
        p = [r.prompt_len for r in self.requests]
        o = [r.max_tokens for r in self.requests]
        return {
            "name": self.name, "seed": self.seed, "stream": self.stream,
            "num_requests": len(self.requests),
            "arrival_rate": "inf" if self.is_offline else self.arrival_rate,
            "burstiness": self.burstiness,
            "dataset": self.profile["dataset"]["kind"],
            "vocab_size": self.vocab_size,
            "total_prompt_tokens": int(sum(p)), "total_max_tokens": int(sum(o)),
            "prompt_len_median": float(np.median(p)) if p else None,
            "output_len_median": float(np.median(o)) if o else None,
            "duration_s": float(self.requests[-1].arrival_offset_s) if self.requests else 0.0,
            "digest": self.digest(),
        }


# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------
def _repo_config_dir() -> Path:
    # engine/llmserve/benchmark/workload.py -> repo root is parents[3]
    return Path(__file__).resolve().parents[3] / "config"


def find_profile_path(name_or_path: str) -> Path | None:
    """Resolve a profile argument: an existing file, or ``config/benchmark-<name>.yaml`` of the
    source checkout. None when neither exists (a built-in name may still match)."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    for cand in (Path.cwd() / "config" / f"benchmark-{name_or_path}.yaml",
                 _repo_config_dir() / f"benchmark-{name_or_path}.yaml"):
        if cand.is_file():
            return cand
    return None


def load_profile(name_or_path: str | None = None) -> tuple[dict[str, Any], str | None]:
    """Read and validate a load profile.

    Args:
        name_or_path: a YAML file, or a built-in name (``sharegpt``, ``lognormal``,
            ``offline-random``); ``None`` is :data:`DEFAULT_PROFILE`.

    Returns:
        ``(profile, path)``: the validated profile with defaults filled in, and the file it came
        from (``None`` for a built-in without a file).

    Raises:
        ValueError: unknown name, unreadable YAML or invalid fields (the message names them).
    """
    import yaml

    name_or_path = name_or_path or DEFAULT_PROFILE
    path = find_profile_path(name_or_path)
    if path is not None:
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"profile {path}: invalid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"profile {path}: must be a YAML mapping, got {type(raw).__name__}")
        raw.setdefault("name", path.stem.removeprefix("benchmark-"))
        return validate_profile(raw, source=str(path)), str(path)
    if name_or_path in BUILTIN_PROFILES:
        return validate_profile(copy.deepcopy(BUILTIN_PROFILES[name_or_path])), None
    raise ValueError(f"profile {name_or_path!r} is neither a file nor a built-in profile; "
                     f"built-ins: {sorted(BUILTIN_PROFILES)}")


def _num(v: Any, field_: str, where: str, *, integer: bool = False, lo: float | None = None,
         lo_open: bool = False, allow_inf: bool = False) -> float | int:
    if isinstance(v, str) and allow_inf and v.strip().lower() in ("inf", ".inf", "infinity"):
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}: {field_} must be a number, got {v!r}")
    if math.isnan(v) or (math.isinf(v) and not allow_inf):
        raise ValueError(f"{where}: {field_} must be finite, got {v!r}")
    if integer and not math.isinf(v):
        if float(v) != int(v):
            raise ValueError(f"{where}: {field_} must be an integer, got {v!r}")
        v = int(v)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{where}: {field_} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    return v


def _check_keys(d: Any, allowed: set[str], where: str) -> dict:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where} must be a mapping, got {d!r}")
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return dict(d)


def _validate_length(d: Any, where: str, dataset_kind: str) -> dict[str, Any]:
    d = _check_keys(d, _LENGTH_KEYS, where)
    dist = d.get("distribution")
    if dist not in LENGTH_DISTRIBUTIONS:
        raise ValueError(f"{where}.distribution must be one of {list(LENGTH_DISTRIBUTIONS)}, got {dist!r}")
    if dist == "dataset" and dataset_kind != "sharegpt":
        raise ValueError(f"{where}.distribution 'dataset' needs dataset.kind 'sharegpt', got {dataset_kind!r}")
    out: dict[str, Any] = {"distribution": dist}
    if dist == "fixed":
        if "value" not in d:
            raise ValueError(f"{where}: distribution 'fixed' needs 'value'")
        out["value"] = _num(d["value"], "value", where, integer=True, lo=1)
        extra = set(d) - {"distribution", "value"}
        if extra:
            raise ValueError(f"{where}: fields {sorted(extra)} do not apply to 'fixed'")
        return out
    for k in ("min", "max"):
        if k not in d:
            raise ValueError(f"{where}: distribution {dist!r} needs '{k}'")
        out[k] = _num(d[k], k, where, integer=True, lo=1)
    if out["min"] > out["max"]:
        raise ValueError(f"{where}: min ({out['min']}) must be <= max ({out['max']})")
    if dist == "lognormal":
        for k in ("median", "sigma"):
            if k not in d:
                raise ValueError(f"{where}: distribution 'lognormal' needs '{k}'")
        out["median"] = float(_num(d["median"], "median", where, lo=0, lo_open=True))
        out["sigma"] = float(_num(d["sigma"], "sigma", where, lo=0))
    else:
        extra = set(d) & {"median", "sigma", "value"}
        if extra:
            raise ValueError(f"{where}: fields {sorted(extra)} do not apply to {dist!r}")
    if "scale" in d:
        if dist != "dataset" or where.endswith("prompt_len"):
            raise ValueError(f"{where}: 'scale' applies only to output_len with distribution 'dataset'")
        out["scale"] = float(_num(d["scale"], "scale", where, lo=0, lo_open=True))
    elif dist == "dataset" and where.endswith("output_len"):
        out["scale"] = 1.0
    return out


def validate_profile(raw: Mapping[str, Any], source: str | None = None) -> dict[str, Any]:
    """Check a profile mapping and return it with defaults filled in (JSON-safe: an infinite
    rate is the string ``"inf"``).

    Raises:
        ValueError: naming the field, the allowed values and the value received.
    """
    where = f"profile {source or raw.get('name', '?')}"
    d = _check_keys(raw, _TOP_KEYS, where)
    out: dict[str, Any] = {"name": str(d.get("name") or "custom"),
                           "description": str(d.get("description") or "")}
    out["seed"] = _num(d.get("seed", 0), "seed", where, integer=True, lo=0)
    out["num_requests"] = _num(d.get("num_requests", 32), "num_requests", where, integer=True, lo=1)
    out["warmup_requests"] = _num(d.get("warmup_requests", 0), "warmup_requests", where, integer=True, lo=0)

    arr = _check_keys(d.get("arrival", {}), _ARRIVAL_KEYS, f"{where}.arrival")
    rate = _num(arr.get("rate", "inf"), "rate", f"{where}.arrival", lo=0, lo_open=True, allow_inf=True)
    out["arrival"] = {"rate": "inf" if math.isinf(rate) else float(rate),
                      "burstiness": float(_num(arr.get("burstiness", 1.0), "burstiness",
                                               f"{where}.arrival", lo=0, lo_open=True))}

    ds = _check_keys(d.get("dataset", {"kind": "synthetic"}), _DATASET_KEYS, f"{where}.dataset")
    kind = ds.get("kind", "synthetic")
    if kind not in DATASET_KINDS:
        raise ValueError(f"{where}.dataset.kind must be one of {list(DATASET_KINDS)}, got {kind!r}")
    path = ds.get("path")
    if path is not None and (kind != "sharegpt" or not isinstance(path, str)):
        raise ValueError(f"{where}.dataset.path must be a ShareGPT JSON path (dataset.kind "
                         f"'sharegpt') or null, got {path!r}")
    out["dataset"] = {"kind": kind, "path": path}

    for key in ("prompt_len", "output_len"):
        if key not in d:
            raise ValueError(f"{where}: missing '{key}' (a length distribution)")
        out[key] = _validate_length(d[key], f"{where}.{key}", kind)
    if kind == "sharegpt" and out["prompt_len"]["distribution"] != "dataset":
        raise ValueError(f"{where}.prompt_len.distribution must be 'dataset' for ShareGPT prompts, "
                         f"got {out['prompt_len']['distribution']!r}")

    ie = d.get("ignore_eos", True)
    if not isinstance(ie, bool):
        raise ValueError(f"{where}: ignore_eos must be true or false, got {ie!r}")
    out["ignore_eos"] = ie
    out["temperature"] = float(_num(d.get("temperature", 0.0), "temperature", where, lo=0))
    if out["temperature"] > 2.0:
        raise ValueError(f"{where}: temperature must be in [0, 2], got {out['temperature']}")
    pr = d.get("priorities", [0])
    if not isinstance(pr, list) or not pr or any(isinstance(x, bool) or not isinstance(x, int) for x in pr):
        raise ValueError(f"{where}: priorities must be a non-empty list of integers, got {pr!r}")
    out["priorities"] = list(pr)
    return out


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------
_STREAMS = ("arrivals", "prompt_len", "output_len", "token_ids", "dataset_order", "priority")


def _rngs(seed: int, stream: int) -> dict[str, np.random.Generator]:
    children = np.random.SeedSequence([int(seed), int(stream)]).spawn(len(_STREAMS))
    return {name: np.random.default_rng(s) for name, s in zip(_STREAMS, children)}


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets (s) of ``n`` requests: 0 then cumulative gamma(shape=burstiness,
    scale=1/(rate*burstiness)) gaps (mean gap ``1/rate``); all zeros when ``rate`` is inf.

    Source: vLLM ``benchmarks/benchmark_serving.py`` (``get_request``).
    """
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def sample_lengths(spec: Mapping[str, Any], n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` integer lengths (tokens) from a validated length spec (not ``dataset``)."""
    dist = spec["distribution"]
    if dist == "fixed":
        return np.full(n, int(spec["value"]), dtype=np.int64)
    lo, hi = int(spec["min"]), int(spec["max"])
    if dist == "uniform":
        return rng.integers(lo, hi + 1, size=n, dtype=np.int64)
    if dist == "lognormal":
        x = rng.lognormal(mean=math.log(spec["median"]), sigma=spec["sigma"], size=n)
        return np.clip(np.rint(x), lo, hi).astype(np.int64)
    raise ValueError(f"sample_lengths cannot draw {dist!r} lengths")


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    if tokenizer is None:
        raise ValueError("ShareGPT prompts need a tokenizer (the engine's) to count tokens")
    if hasattr(tokenizer, "encode"):
        def enc(text: str) -> list[int]:
            try:
                return list(tokenizer.encode(text, add_special_tokens=False))
            except TypeError:
                return list(tokenizer.encode(text))
        return enc
    if callable(tokenizer):
        return lambda text: list(tokenizer(text))
    raise ValueError(f"tokenizer must have .encode(text) or be callable, got {type(tokenizer).__name__}")


def build_workload(profile: Mapping[str, Any], *, seed: int | None = None,
                   num_requests: int | None = None, arrival_rate: float | str | None = None,
                   tokenizer: Any = None, vocab_size: int | None = None, stream: int = 0,
                   sharegpt_path: str | None = None) -> Workload:
    """Generate the requests of a validated profile.

    Args:
        profile: output of :func:`validate_profile` / :func:`load_profile`.
        seed: overrides ``profile['seed']``.
        num_requests: overrides ``profile['num_requests']``.
        arrival_rate: overrides ``profile['arrival']['rate']`` (req/s; ``inf``/``"inf"`` offline).
        tokenizer: needed for ShareGPT (``.encode(text, add_special_tokens=False)`` or a callable).
        vocab_size: exclusive upper bound of synthetic token ids (default 151,643, the Qwen2
            base vocabulary; pass ``min(model vocab, tokenizer base vocab)``).
        stream: 0 for the measured requests, 1 for warm-up (independent random streams).
        sharegpt_path: overrides ``profile['dataset']['path']``.

    Returns:
        A :class:`Workload` with requests sorted by arrival (index order).

    Raises:
        ValueError: bad overrides, or the dataset yields fewer usable prompts than requested.
    """
    prof = copy.deepcopy(dict(profile))
    seed = int(prof["seed"] if seed is None else seed)
    n = int(prof["num_requests"] if num_requests is None else num_requests)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if n < 0:
        raise ValueError(f"num_requests must be >= 0, got {n}")
    rate = _num(prof["arrival"]["rate"] if arrival_rate is None else arrival_rate, "arrival rate",
                "workload", lo=0, lo_open=True, allow_inf=True)
    prof["seed"], prof["num_requests"] = seed, n
    prof["arrival"]["rate"] = "inf" if math.isinf(rate) else float(rate)
    if sharegpt_path is not None:
        prof["dataset"]["path"] = sharegpt_path
    burst = float(prof["arrival"]["burstiness"])
    vocab = int(vocab_size or DEFAULT_VOCAB_SIZE)
    if vocab < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab}")

    rngs = _rngs(seed, stream)
    offsets = arrival_offsets(n, float(rate), burst, rngs["arrivals"])
    priorities = rngs["priority"].choice(np.asarray(prof["priorities"]), size=n) if n else []
    ospec = prof["output_len"]
    out_lens = sample_lengths(ospec, n, rngs["output_len"]) if ospec["distribution"] != "dataset" else None

    requests: list[BenchmarkRequest] = []
    if prof["dataset"]["kind"] == "synthetic":
        plens = sample_lengths(prof["prompt_len"], n, rngs["prompt_len"])
        tok_rng = rngs["token_ids"]
        for i in range(n):
            ids = tok_rng.integers(0, vocab, size=int(plens[i]), dtype=np.int64).tolist()
            requests.append(BenchmarkRequest(i, float(offsets[i]), ids, len(ids), int(out_lens[i]),
                                             prof["ignore_eos"], int(priorities[i])))
    else:
        from .sharegpt import load_sharegpt_pairs

        pairs = load_sharegpt_pairs(prof["dataset"]["path"])
        enc = _encoder(tokenizer)
        pspec = prof["prompt_len"]
        order = rngs["dataset_order"].permutation(len(pairs))
        for j in order:
            if len(requests) == n:
                break
            pair = pairs[int(j)]
            ids = enc(pair.prompt)
            if len(ids) < pspec["min"]:
                continue
            ids = ids[: pspec["max"]]
            if out_lens is None:
                olen = int(np.clip(round(len(enc(pair.reply)) * ospec["scale"]), ospec["min"], ospec["max"]))
            else:
                olen = int(out_lens[len(requests)])
            i = len(requests)
            requests.append(BenchmarkRequest(i, float(offsets[i]), ids, len(ids), olen,
                                             prof["ignore_eos"], int(priorities[i]),
                                             prompt_text=pair.prompt, source_id=pair.id))
        if len(requests) < n:
            raise ValueError(f"ShareGPT yields only {len(requests)} prompts with >= "
                             f"{pspec['min']} tokens; {n} requested")
    return Workload(name=prof["name"], seed=seed, stream=stream, arrival_rate=float(rate),
                    burstiness=burst, profile=prof, requests=requests,
                    vocab_size=vocab if prof["dataset"]["kind"] == "synthetic" else None)

