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

Workload kinds (``workload.kind``), for prefix caching:
  * ``single-turn`` (default): one prompt per request, as above;
  * ``shared-prefix``: the same system prompt of ``system_prompt_len`` tokens in front of every
    prompt. ShareGPT prompts are rendered through the chat template as ``[system, user]``
    (the system text is a fixed instruction paragraph cut to the first whole word that reaches
    ``system_prompt_len`` tokens); synthetic prompts get ``system_prompt_len`` seeded random ids
    in front. ``prompt_len.max`` applies to the user part;
  * ``multi-turn`` (ShareGPT only): conversations replayed turn by turn through the chat
    template; turn k's prompt is the whole conversation so far (every earlier user turn and the
    dataset's assistant reply to it) plus the k-th user turn, and its output length is the k-th
    reply's token count (``output_len``). ``arrival`` gives each conversation's first turn;
    turn k+1 arrives ``think_time_s`` seconds after turn k finished (closed loop within a
    conversation, so several conversations interleave). A conversation ends after
    ``max_turns`` turns, at its last reply, or before a turn whose prompt would exceed
    ``prompt_len.max``; conversations with fewer than ``min_turns`` such turns are skipped;
    ``num_requests`` counts turns (the last conversation may be cut short). With
    ``multi_turn_system_prompt_len`` > 0 every conversation opens with the shared system
    prompt of that many tokens (the text shared-prefix uses), as an assistant or agent
    deployment sends its instructions: the resent history then dominates each prompt, and
    ``prompt_len.max`` counts the system prompt too.

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
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BenchmarkRequest", "Workload", "BUILTIN_PROFILES", "load_profile", "validate_profile",
           "build_workload", "sample_lengths", "arrival_offsets", "find_profile_path",
           "DEFAULT_PROFILE", "DEFAULT_VOCAB_SIZE", "WORKLOAD_KINDS", "load_sharegpt_conversations",
           "system_prompt_text"]

#: Qwen2 base vocabulary (ids >= 151643 are special tokens); the default synthetic id range.
DEFAULT_VOCAB_SIZE = 151_643
DEFAULT_PROFILE = "sharegpt"

LENGTH_DISTRIBUTIONS = ("lognormal", "uniform", "fixed", "dataset")
DATASET_KINDS = ("synthetic", "sharegpt")
WORKLOAD_KINDS = ("single-turn", "shared-prefix", "multi-turn")
_TOP_KEYS = {"name", "description", "seed", "num_requests", "warmup_requests", "arrival",
             "dataset", "prompt_len", "output_len", "ignore_eos", "temperature", "priorities",
             "workload"}
_WORKLOAD_KEYS = {"kind", "system_prompt_len", "max_turns", "min_turns", "think_time_s",
                  "multi_turn_system_prompt_len"}
#: Defaults of the ``workload`` section (``kind`` single-turn ignores the others).
WORKLOAD_DEFAULTS = {"kind": "single-turn", "system_prompt_len": 256, "max_turns": 4,
                     "min_turns": 1, "think_time_s": 0.5, "multi_turn_system_prompt_len": 0}
#: Source text of the shared system prompt (repeated, then cut to ``system_prompt_len`` tokens).
SYSTEM_PROMPT_TEXT = (
    "You are a helpful, careful and honest assistant. Answer the user's question directly and "
    "completely, explain your reasoning step by step when it helps, say when you are not sure, "
    "and never invent facts, names, numbers or sources. Prefer short paragraphs and plain "
    "words; use lists for steps and tables for comparisons; show code in fenced blocks with "
    "the language named. When a request is ambiguous, state the reading you chose. Keep a "
    "friendly, professional tone, respect the user's time, and follow the user's formatting "
    "instructions over these ones. ")
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
    "multiturn": {
        "name": "multiturn",
        "description": "ShareGPT V3 conversations replayed turn by turn through the chat "
                       "template (each turn's prompt is the conversation so far), up to 4 turns, "
                       "0.5 s think time after each reply; conversations start at 2/s Poisson; "
                       "prompts up to 1024 tokens, output = 1/8 of the reply clipped to [4, 64].",
        "seed": 0,
        "num_requests": 32,
        "warmup_requests": 1,
        "arrival": {"rate": 2.0, "burstiness": 1.0},
        "dataset": {"kind": "sharegpt", "path": None},
        "prompt_len": {"distribution": "dataset", "min": 4, "max": 1024},
        "output_len": {"distribution": "dataset", "scale": 0.125, "min": 4, "max": 64},
        "ignore_eos": True,
        "temperature": 0.0,
        "priorities": [0],
        "workload": {"kind": "multi-turn", "system_prompt_len": 256, "max_turns": 4,
                     "min_turns": 1, "think_time_s": 0.5, "multi_turn_system_prompt_len": 0},
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
        conversation: multi-turn workloads: index of the conversation (``None`` otherwise).
        turn: 0-based turn within the conversation; a turn > 0 is submitted only after the
            previous turn finished, ``think_time_s`` later (``arrival_offset_s`` is then a
            placeholder: the previous turn's).
        think_time_s: seconds between the previous turn's end and this turn's arrival.
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
    conversation: int | None = None
    turn: int = 0
    think_time_s: float = 0.0

    def spec(self) -> dict[str, Any]:
        """The fields that define the request (for digests and records), without the text."""
        d = {"index": self.index, "arrival_offset_s": round(float(self.arrival_offset_s), 9),
             "prompt_len": self.prompt_len, "max_tokens": self.max_tokens,
             "ignore_eos": self.ignore_eos, "priority": self.priority,
             "source_id": self.source_id}
        if self.conversation is not None:
            d.update(conversation=self.conversation, turn=self.turn,
                     think_time_s=round(float(self.think_time_s), 9))
        return d


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
            "workload_kind": self.profile.get("workload", WORKLOAD_DEFAULTS)["kind"],
            "num_conversations": len({r.conversation for r in self.requests
                                      if r.conversation is not None}) or None,
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
    wl = _check_keys(d.get("workload", {}), _WORKLOAD_KEYS, f"{where}.workload")
    wk = wl.get("kind", WORKLOAD_DEFAULTS["kind"])
    if wk not in WORKLOAD_KINDS:
        raise ValueError(f"{where}.workload.kind must be one of {list(WORKLOAD_KINDS)}, got {wk!r}")
    if wk == "multi-turn" and kind != "sharegpt":
        raise ValueError(f"{where}.workload.kind 'multi-turn' needs dataset.kind 'sharegpt', got {kind!r}")
    out["workload"] = {
        "kind": wk,
        "system_prompt_len": _num(wl.get("system_prompt_len", WORKLOAD_DEFAULTS["system_prompt_len"]),
                                  "system_prompt_len", f"{where}.workload", integer=True, lo=1),
        "max_turns": _num(wl.get("max_turns", WORKLOAD_DEFAULTS["max_turns"]), "max_turns",
                          f"{where}.workload", integer=True, lo=1),
        "min_turns": _num(wl.get("min_turns", WORKLOAD_DEFAULTS["min_turns"]), "min_turns",
                          f"{where}.workload", integer=True, lo=1),
        "think_time_s": float(_num(wl.get("think_time_s", WORKLOAD_DEFAULTS["think_time_s"]),
                                   "think_time_s", f"{where}.workload", lo=0)),
        "multi_turn_system_prompt_len": _num(
            wl.get("multi_turn_system_prompt_len", WORKLOAD_DEFAULTS["multi_turn_system_prompt_len"]),
            "multi_turn_system_prompt_len", f"{where}.workload", integer=True, lo=0),
    }
    system_len = out["workload"]["multi_turn_system_prompt_len"]
    if wk == "multi-turn" and system_len >= out["prompt_len"]["max"]:
        raise ValueError(f"{where}.workload.multi_turn_system_prompt_len ({system_len}) leaves no room for a "
                         f"conversation within prompt_len.max ({out['prompt_len']['max']}): it counts the "
                         "system prompt too")
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


#: Token ids of texts already encoded in this process, keyed by (``id`` of the tokenizer,
#: text): the cells of a pipeline process build the same ShareGPT workloads again and again (a
#: multi-turn workload renders and encodes ~300 conversations of up to 8k tokens, 1-2 s on a host
#: CPU), with the one tokenizer object :func:`llmserve.tokenizer.load_tokenizer` memoises. Each
#: entry holds its tokenizer, so no other object can take that ``id`` while the entry lives.
#: Least recently used entries go first once the entries hold more than
#: :data:`ENCODE_CACHE_TOKENS` token ids (4 bytes each).
_ENCODE_CACHE: "OrderedDict[tuple[int, str], tuple[Any, array]]" = OrderedDict()
ENCODE_CACHE_TOKENS = 16 * 1024 * 1024
_encode_cache_tokens = 0


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    if tokenizer is None:
        raise ValueError("ShareGPT prompts need a tokenizer (the engine's) to count tokens")
    if hasattr(tokenizer, "encode"):
        def encode(text: str) -> list[int]:
            try:
                return list(tokenizer.encode(text, add_special_tokens=False))
            except TypeError:
                return list(tokenizer.encode(text))

        key = id(tokenizer)

        def enc(text: str) -> list[int]:
            global _encode_cache_tokens
            hit = _ENCODE_CACHE.get((key, text))
            if hit is not None:       # the entry holds its tokenizer: the id is this one's
                _ENCODE_CACHE.move_to_end((key, text))
                return hit[1].tolist()
            ids = encode(text)
            try:
                packed = array("i", ids)
            except (OverflowError, TypeError):   # not 32-bit ids: left out of the cache
                return ids
            _encode_cache_tokens += len(packed)
            _ENCODE_CACHE[(key, text)] = (tokenizer, packed)
            while _encode_cache_tokens > ENCODE_CACHE_TOKENS and _ENCODE_CACHE:
                _encode_cache_tokens -= len(_ENCODE_CACHE.popitem(last=False)[1][1])
            return ids
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

    wl = prof.setdefault("workload", dict(WORKLOAD_DEFAULTS))
    requests: list[BenchmarkRequest] = []
    if wl["kind"] == "multi-turn":
        requests = _multi_turn_requests(prof, n, offsets, priorities, out_lens, rngs, tokenizer)
    elif prof["dataset"]["kind"] == "synthetic":
        plens = sample_lengths(prof["prompt_len"], n, rngs["prompt_len"])
        tok_rng = rngs["token_ids"]
        # shared-prefix: one seeded system prefix, drawn before (and independent of) the prompts
        system = (np.random.default_rng([seed, stream, 7]).integers(
            0, vocab, size=wl["system_prompt_len"], dtype=np.int64).tolist()
            if wl["kind"] == "shared-prefix" else [])
        for i in range(n):
            ids = system + tok_rng.integers(0, vocab, size=int(plens[i]), dtype=np.int64).tolist()
            requests.append(BenchmarkRequest(i, float(offsets[i]), ids, len(ids), int(out_lens[i]),
                                             prof["ignore_eos"], int(priorities[i])))
    else:
        from .sharegpt import load_sharegpt_pairs

        pairs = load_sharegpt_pairs(prof["dataset"]["path"])
        enc = _encoder(tokenizer)
        pspec = prof["prompt_len"]
        head: list[int] = []
        tail: list[int] = []
        if wl["kind"] == "shared-prefix":
            head, tail = _shared_prefix_frame(tokenizer, enc, wl["system_prompt_len"])
        order = rngs["dataset_order"].permutation(len(pairs))
        for j in order:
            if len(requests) == n:
                break
            pair = pairs[int(j)]
            ids = enc(pair.prompt)
            if len(ids) < pspec["min"]:
                continue
            ids = head + ids[: pspec["max"]] + tail
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



# ---------------------------------------------------------------------------------------------
# Prefix-sharing workloads
# ---------------------------------------------------------------------------------------------
_USER_SENTINEL = "\u2063USER_TURN\u2063"
_conversation_cache: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {}


def system_prompt_text(enc: Callable[[str], list[int]], num_tokens: int) -> str:
    """The shared system prompt: :data:`SYSTEM_PROMPT_TEXT` repeated and cut at the first whole
    word where its encoding reaches ``num_tokens`` tokens (bisection over the word count)."""
    base = SYSTEM_PROMPT_TEXT.split()
    words = base * max(1, -(-num_tokens // max(1, len(enc(SYSTEM_PROMPT_TEXT)))) + 1)
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(enc(" ".join(words[:mid]))) >= num_tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    from ..tokenizer import apply_chat_template

    return apply_chat_template(tokenizer, messages, add_generation_prompt=True)


def _shared_prefix_frame(tokenizer: Any, enc: Callable[[str], list[int]], system_len: int
                         ) -> tuple[list[int], list[int]]:
    """Token ids before and after the user's text in ``[system, user]`` rendered by the chat
    template (the template is rendered with a sentinel user text, split around it)."""
    text = _render(tokenizer, [{"role": "system", "content": system_prompt_text(enc, system_len)},
                               {"role": "user", "content": _USER_SENTINEL}])
    before, after = text.split(_USER_SENTINEL)
    return enc(before), enc(after)


def load_sharegpt_conversations(path: str | None = None) -> list[tuple[str, list[tuple[str, str]]]]:
    """ShareGPT conversations as ``(id, [(user text, assistant reply), ...])``: the leading run
    of human -> assistant turn pairs of each record (conversations without one are skipped).
    Memoised per file."""
    from .sharegpt import ASSISTANT_ROLES, HUMAN_ROLES, iter_json_array_records, packaged_sharegpt_path

    src = Path(path).expanduser() if path else packaged_sharegpt_path()
    key = str(src.resolve())
    if key not in _conversation_cache:
        convs = []
        for rec in iter_json_array_records(src.read_text(encoding="utf-8")):
            msgs = rec.get("conversations") if isinstance(rec, dict) else None
            if not isinstance(msgs, list):
                continue
            turns: list[tuple[str, str]] = []
            for a, b in zip(msgs[0::2], msgs[1::2]):
                if not (isinstance(a, dict) and isinstance(b, dict)):
                    break
                u, r = a.get("value"), b.get("value")
                if (str(a.get("from", "")).lower() not in HUMAN_ROLES
                        or str(b.get("from", "")).lower() not in ASSISTANT_ROLES
                        or not isinstance(u, str) or not isinstance(r, str)
                        or not u.strip() or not r.strip()):
                    break
                turns.append((u, r))
            if turns:
                convs.append((str(rec.get("id", "")), turns))
        _conversation_cache[key] = convs
    return _conversation_cache[key]


def _multi_turn_requests(prof: dict[str, Any], n: int, offsets: np.ndarray, priorities: Any,
                         out_lens: np.ndarray | None, rngs: dict[str, np.random.Generator],
                         tokenizer: Any) -> list[BenchmarkRequest]:
    """Requests of the ``multi-turn`` workload (see the module docstring)."""
    wl, pspec, ospec = prof["workload"], prof["prompt_len"], prof["output_len"]
    enc = _encoder(tokenizer)
    convs = load_sharegpt_conversations(prof["dataset"]["path"])
    order = rngs["dataset_order"].permutation(len(convs))
    requests: list[BenchmarkRequest] = []
    system_len = wl.get("multi_turn_system_prompt_len", 0)
    system = [{"role": "system", "content": system_prompt_text(enc, system_len)}] if system_len else []
    c = 0
    for j in order:
        if len(requests) == n:
            break
        cid, turns = convs[int(j)]
        messages: list[dict[str, str]] = list(system)
        conv_reqs: list[BenchmarkRequest] = []
        for k, (user, reply) in enumerate(turns[: wl["max_turns"]]):
            if len(requests) + len(conv_reqs) == n:
                break
            messages.append({"role": "user", "content": user})
            text = _render(tokenizer, messages)
            ids = enc(text)
            if len(ids) > pspec["max"] or (k == 0 and len(ids) < pspec["min"]):
                break
            i = len(requests) + len(conv_reqs)
            if out_lens is None:
                olen = int(np.clip(round(len(enc(reply)) * ospec["scale"]), ospec["min"], ospec["max"]))
            else:
                olen = int(out_lens[i])
            conv_reqs.append(BenchmarkRequest(
                i, float(offsets[c]), ids, len(ids), olen, prof["ignore_eos"], int(priorities[i]),
                prompt_text=text, source_id=cid, conversation=c, turn=k,
                think_time_s=float(wl["think_time_s"]) if k else 0.0))
            messages.append({"role": "assistant", "content": reply})
        if conv_reqs and (len(conv_reqs) >= wl["min_turns"] or len(requests) + len(conv_reqs) == n):
            requests.extend(conv_reqs)
            c += 1
    if len(requests) < n:
        raise ValueError(f"ShareGPT yields only {len(requests)} turns within prompt_len "
                         f"[{pspec['min']}, {pspec['max']}]; {n} requested")
    return requests
