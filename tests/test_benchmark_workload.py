"""Benchmark workloads: determinism, length distributions, arrivals, profiles, ShareGPT loader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from llmserve.bench import sharegpt
from llmserve.bench.workload import (
    BUILTIN_PROFILES,
    arrival_offsets,
    build_workload,
    load_profile,
    sample_lengths,
    validate_profile,
)

REPO = Path(__file__).resolve().parents[1]


def _words(text: str) -> list[int]:
    """A deterministic stand-in tokenizer: one id per whitespace-separated word."""
    return [len(w) % 1000 for w in text.split()]


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_yaml_profiles_match_builtins(name):
    prof, path = load_profile(name)
    assert path is not None and Path(path) == REPO / "config" / f"benchmark-{name}.yaml"
    assert prof == validate_profile(BUILTIN_PROFILES[name])


@pytest.mark.parametrize("name", ["lognormal", "offline-random"])
def test_same_seed_same_workload(name):
    prof, _ = load_profile(name)
    a = build_workload(prof, num_requests=64, vocab_size=1000)
    b = build_workload(prof, num_requests=64, vocab_size=1000)
    assert a.digest() == b.digest()
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.arrival_offset_s for r in a.requests] == [r.arrival_offset_s for r in b.requests]
    c = build_workload(prof, seed=1, num_requests=64, vocab_size=1000)
    assert c.digest() != a.digest()
    warm = build_workload(prof, num_requests=64, vocab_size=1000, stream=1)
    assert warm.digest() != a.digest()


def test_sharegpt_workload_deterministic_and_clipped():
    prof, _ = load_profile("sharegpt")
    a = build_workload(prof, num_requests=50, tokenizer=_words)
    b = build_workload(prof, num_requests=50, tokenizer=_words)
    assert a.digest() == b.digest()
    assert [r.source_id for r in a.requests] == [r.source_id for r in b.requests]
    p, o = prof["prompt_len"], prof["output_len"]
    for r in a.requests:
        assert p["min"] <= r.prompt_len <= p["max"] == 512
        assert len(r.prompt_token_ids) == r.prompt_len
        assert o["min"] <= r.max_tokens <= o["max"]
        assert r.prompt_text and r.ignore_eos


@pytest.mark.parametrize("name", ["lognormal", "offline-random"])
def test_lengths_within_clip_bounds(name):
    prof, _ = load_profile(name)
    w = build_workload(prof, num_requests=2000, vocab_size=500)
    for key, attr in (("prompt_len", "prompt_len"), ("output_len", "max_tokens")):
        vals = np.array([getattr(r, attr) for r in w.requests])
        assert vals.min() >= prof[key]["min"] and vals.max() <= prof[key]["max"]
    ids = np.concatenate([r.prompt_token_ids for r in w.requests])
    assert ids.min() >= 0 and ids.max() < 500


def test_lognormal_median_and_sigma_within_5_percent():
    prof, _ = load_profile("lognormal")
    rng = np.random.default_rng(123)
    for key in ("prompt_len", "output_len"):
        spec = prof[key]
        x = sample_lengths(spec, 10_000, rng)
        assert x.min() >= spec["min"] and x.max() <= spec["max"]
        assert abs(np.median(x) / spec["median"] - 1) < 0.05
        assert abs(np.log(x).std() / spec["sigma"] - 1) < 0.05


def test_uniform_lengths_cover_range():
    x = sample_lengths({"distribution": "uniform", "min": 100, "max": 1024}, 10_000,
                       np.random.default_rng(0))
    assert x.min() == 100 and x.max() == 1024
    assert abs(x.mean() - 562) < 10


def test_poisson_arrivals_mean_rate_and_burstiness():
    rng = np.random.default_rng(0)
    t = arrival_offsets(20_000, 4.0, 1.0, rng)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.25) / 0.25 < 0.03
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05          # exponential: CV = 1
    bursty = np.diff(arrival_offsets(20_000, 4.0, 0.25, np.random.default_rng(0)))
    assert abs(bursty.mean() - 0.25) / 0.25 < 0.05
    assert abs(bursty.std() / bursty.mean() - 2.0) < 0.1       # gamma shape k: CV = 1/sqrt(k)
    assert np.all(arrival_offsets(5, math.inf, 1.0, rng) == 0)


def test_offline_profile_and_rate_override():
    prof, _ = load_profile("offline-random")
    w = build_workload(prof, num_requests=256, vocab_size=1000)
    assert w.is_offline and len(w) == 256
    assert all(r.arrival_offset_s == 0.0 and r.ignore_eos for r in w.requests)
    w2 = build_workload(prof, num_requests=8, arrival_rate=20, vocab_size=1000)
    assert not w2.is_offline and w2.requests[-1].arrival_offset_s > 0
    # changing the arrival rate does not change the lengths or prompts
    w3 = build_workload(prof, num_requests=8, vocab_size=1000)
    assert [r.prompt_token_ids for r in w2.requests] == [r.prompt_token_ids for r in w3.requests]


@pytest.mark.parametrize("mutate, match", [
    (lambda p: p.update(bogus=1), r"unknown field\(s\) \['bogus'\]"),
    (lambda p: p["arrival"].update(rate=-1), r"rate must be > 0"),
    (lambda p: p["arrival"].update(burstiness=0), r"burstiness must be > 0"),
    (lambda p: p["prompt_len"].update(min=50, max=10), r"min \(50\) must be <= max \(10\)"),
    (lambda p: p["prompt_len"].update(distribution="zipf"), r"distribution must be one of"),
    (lambda p: p["prompt_len"].pop("median"), r"needs 'median'"),
    (lambda p: p["output_len"].update(sigma="wide"), r"sigma must be a number"),
    (lambda p: p["output_len"].update(distribution="dataset"), r"needs dataset.kind 'sharegpt'"),
    (lambda p: p["dataset"].update(kind="wiki"), r"dataset.kind must be one of"),
    (lambda p: p.update(num_requests=2.5), r"num_requests must be an integer"),
    (lambda p: p.update(ignore_eos="yes"), r"ignore_eos must be true or false"),
    (lambda p: p.update(priorities=[]), r"priorities must be a non-empty list"),
    (lambda p: p.pop("output_len"), r"missing 'output_len'"),
])
def test_profile_validation_errors_name_the_field(mutate, match):
    import copy
    raw = copy.deepcopy(BUILTIN_PROFILES["lognormal"])
    mutate(raw)
    with pytest.raises(ValueError, match=match):
        validate_profile(raw)


def test_profile_file_and_unknown_name(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"num_requests": 3, "arrival": {"rate": "inf"},
                                 "prompt_len": {"distribution": "fixed", "value": 7},
                                 "output_len": {"distribution": "fixed", "value": 2}}))
    prof, path = load_profile(str(f))
    assert path == str(f) and prof["name"] == "p" and prof["arrival"]["rate"] == "inf"
    w = build_workload(prof, vocab_size=100)
    assert [r.prompt_len for r in w.requests] == [7, 7, 7] and [r.max_tokens for r in w.requests] == [2, 2, 2]
    with pytest.raises(ValueError, match="neither a file nor a built-in"):
        load_profile("no-such-profile")


# ---- ShareGPT ----------------------------------------------------------------------------------
def test_sharegpt_packaged_file_yields_over_10k_conversations():
    path = sharegpt.packaged_sharegpt_path()
    with pytest.raises(json.JSONDecodeError):       # the packaged copy is truncated
        json.loads(path.read_text(encoding="utf-8", errors="replace"))
    pairs = sharegpt.load_sharegpt_pairs()
    assert len(pairs) >= 10_000
    assert all(p.prompt.strip() and p.reply.strip() for p in pairs[:500])
    assert sharegpt.load_sharegpt_pairs() is pairs   # parsed once per process


def test_sharegpt_loader_truncated_user_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi there"},
                                      {"from": "gpt", "value": "hello you"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "orphan"},
                                      {"from": "human", "value": "question"},
                                      {"from": "gpt", "value": "answer"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "no reply"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "cut"}, {"from": "gpt", "value": "off"}]},
    ]
    text = json.dumps(recs, indent=1)
    f = tmp_path / "sg.json"
    f.write_text(text[: text.rindex('"off"') + 2])    # truncated inside the last record
    sharegpt.clear_cache()
    pairs = sharegpt.load_sharegpt_pairs(f)
    assert [(p.id, p.prompt, p.reply) for p in pairs] == [("a", "hi there", "hello you"),
                                                          ("b", "question", "answer")]
    sharegpt.clear_cache()                             # now served from the disk cache
    assert sharegpt.load_sharegpt_pairs(f) == pairs
    assert list((tmp_path / "cache" / "sharegpt").glob("*.json"))
    with pytest.raises(FileNotFoundError):
        sharegpt.load_sharegpt_pairs(tmp_path / "missing.json")


class _CountingTokenizer:
    """A stand-in tokenizer with ``encode`` that counts its calls (one id per word)."""

    def __init__(self, offset: int = 0) -> None:
        self.calls = 0
        self.offset = offset

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        return [(len(w) + self.offset) % 1000 for w in text.split()]


@pytest.mark.parametrize("kind", ["single-turn", "multi-turn"])
def test_a_rebuilt_workload_reuses_its_encodings(kind):
    """The same workload built again in a process encodes nothing again and gives the same
    requests; another tokenizer object never gets the first one's ids."""
    prof, _ = load_profile("sharegpt")
    prof = validate_profile({**prof, "workload": {**prof["workload"], "kind": kind}})
    tok = _CountingTokenizer()
    a = build_workload(prof, num_requests=20, tokenizer=tok)
    first = tok.calls
    assert first > 0
    b = build_workload(prof, num_requests=20, tokenizer=tok)
    assert tok.calls == first
    assert a.digest() == b.digest()
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    b.requests[0].prompt_token_ids.append(7)   # a caller's list is its own, never the cache's
    c = build_workload(prof, num_requests=20, tokenizer=tok)
    assert c.digest() == a.digest()
    other = _CountingTokenizer(offset=1)
    d = build_workload(prof, num_requests=20, tokenizer=other)
    assert other.calls > 0 and d.digest() != a.digest()


def test_encode_cache_is_bounded_by_tokens(monkeypatch):
    """Past ``ENCODE_CACHE_TOKENS`` token ids the least recently used texts are dropped (and
    encoded again when met again); the count of held ids stays within the bound."""
    from llmserve.bench import workload as W

    monkeypatch.setattr(W, "_ENCODE_CACHE", W.OrderedDict())
    monkeypatch.setattr(W, "_encode_cache_tokens", 0)
    monkeypatch.setattr(W, "ENCODE_CACHE_TOKENS", 10)
    tok = _CountingTokenizer()
    enc = W._encoder(tok)
    assert enc("a b c d") == [1, 1, 1, 1] and enc("a b c d") == [1, 1, 1, 1] and tok.calls == 1
    enc("e f g h i j")                      # 4 + 6 = 10 ids: both kept
    assert tok.calls == 2 and W._encode_cache_tokens == 10
    enc("k l")                              # 12 > 10: the oldest text goes
    assert W._encode_cache_tokens == 8 and len(W._ENCODE_CACHE) == 2
    enc("a b c d")
    assert tok.calls == 4
    assert W._encode_cache_tokens <= 10
