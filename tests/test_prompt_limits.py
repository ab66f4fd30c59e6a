"""Bounded prompt tokenization on the built-in Qwen2 tokenizer: the character and prefix proofs
never claim more tokens than the text has (random texts built to stress the pre-tokenizer:
whitespace runs, newlines, punctuation, digits, combining marks, Hangul jamo, special tokens,
long words), and a text far over the limit is refused after a small prefix."""

from __future__ import annotations

import random
import sys
import time
import unicodedata

import pytest

from llmserve.serve.prompt_limits import NFC_MAX_SHRINK, TokenBudget, TooManyTokens, _cut_point


@pytest.fixture(scope="module")
def tok():
    from llmserve.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def budget(tok):
    b = TokenBudget(tok)
    b.prepare()
    return b


def test_nfc_shrinks_a_text_by_at_most_the_longest_canonical_decomposition():
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
                  if not 0xD800 <= c <= 0xDFFF)
    assert longest == NFC_MAX_SHRINK
    # the worst cases compose back to a quarter / a third
    assert len(unicodedata.normalize("NFC", "\u03b1\u0313\u0300\u0345" * 10)) == 10
    assert len(unicodedata.normalize("NFC", "\u1100\u1161\u11a8" * 10)) == 10


def test_the_qwen_tokenizer_has_a_bound(budget):
    assert budget.max_chars_per_token == 128
    assert budget.quick_lower_bound(6_000_000) == -(-6_000_000 // 512)


PIECES = ["hello", " world", "  ", "\n", "\n\n  ", "\t", ", ", "123", "4567890", "'s", " 're", "--", "-" * 200,
          " " * 150, "é", "e\u0301", "\u0301\u0302", "\u1100\u1161\u11a8", "\u03b1\u0313\u0300\u0345", "漢字",
          "😀", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "a" * 300, "x=1;", "\r\n", "ǅ", "\u00a0", "..."]


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def test_proofs_never_overcount(tok, budget):
    rng = random.Random(7)
    for trial in range(120):
        text = _random_text(rng, rng.randint(5, 400))
        full = len(tok.encode(text, add_special_tokens=False))
        assert budget.lower_bound(text) <= full
        assert budget.quick_lower_bound(len(text)) <= full
        for _ in range(6):
            cut = _cut_point(text, rng.randint(1, len(text)))
            if cut:
                assert budget._tokens_before_last_pieces(text[:cut]) <= full, (trial, cut, text)


def test_worst_case_texts_for_the_character_bound(tok, budget):
    for text in ("-" * 128 * 40, " " * 5000, "\u03b1\u0313\u0300\u0345" * 500, "a" * 20000):
        assert budget.lower_bound(text) <= len(tok.encode(text, add_special_tokens=False))


def test_encode_is_exact_under_the_limit_and_refuses_over_it(tok, budget):
    text = "The quick brown fox jumps over the lazy dog. " * 200
    ids = tok.encode(text, add_special_tokens=False)
    assert budget.encode(text, len(ids) + 1) == ids
    assert budget.encode(text, None) == ids
    with pytest.raises(TooManyTokens) as e:
        budget.encode(text, len(ids))
    assert e.value.at_least <= len(ids)


def test_a_long_prompt_is_refused_after_a_small_prefix(budget):
    rng = random.Random(0)
    text = " ".join(rng.choice(["alpha", "beta", "gamma", "x=1;", "été"]) for _ in range(300_000))
    assert 1_000_000 < len(text) < 4 * 128 * 4096     # not refused by its length alone
    t = time.perf_counter()
    with pytest.raises(TooManyTokens) as e:
        budget.encode(text, 4096)
    took = time.perf_counter() - t
    assert e.value.at_least >= 4096
    assert took < 0.5, took          # tokenizing it all takes seconds


def test_a_tokenizer_without_known_structure_is_tokenized_in_full():
    class Plain:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    b = TokenBudget(Plain())
    assert b.quick_lower_bound(10**9) == 0 and b.lower_bound("abc") == 0
    assert b.encode("abc", 10) == [97, 98, 99]
    with pytest.raises(TooManyTokens):
        b.encode("abc", 3)
