"""Incremental detokenization: UTF-8 safety, stop strings across token boundaries, flushing.

A fake byte-level tokenizer (each token is an arbitrary byte string, decoded like a byte-level
BPE: bytes joined, then UTF-8 with replacement) lets the tests split characters anywhere; the
real Qwen tokenizer checks the same on tokens that really split a character.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.serve.detokenizer import IncrementalDetokenizer, token_bytes, token_text

FFFD = "\ufffd"


class ByteTokenizer:
    """Token i is ``pieces[i]`` (bytes); ``special`` ids decode to '' with skip_special_tokens."""

    def __init__(self, pieces: list[bytes], special: dict[int, str] | None = None) -> None:
        self.pieces = pieces
        self.special = special or {}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        out = b""
        for i in ids:
            if i in self.special:
                if not skip_special_tokens:
                    out += self.special[i].encode()
                continue
            out += self.pieces[i]
        return out.decode("utf-8", errors="replace")


def tokenize_bytes(text: str, cuts: list[int]) -> tuple[ByteTokenizer, list[int]]:
    """Split ``text``'s UTF-8 bytes at the given byte offsets; one token per piece."""
    data = text.encode("utf-8")
    bounds = sorted({c for c in cuts if 0 < c < len(data)})
    pieces, prev = [], 0
    for b in bounds + [len(data)]:
        pieces.append(data[prev:b])
        prev = b
    return ByteTokenizer(pieces), list(range(len(pieces)))


def run(tok, ids, stop=(), finish=True):
    d = IncrementalDetokenizer(tok, stop)
    deltas = [d.add_token(i) for i in ids]
    if finish:
        deltas.append(d.finish())
    return d, deltas


def expected(tok, ids, stops) -> str:
    """Reference: after each token, decode the whole prefix; the first time a stop string is
    in it, cut at its earliest occurrence (generation stops at the token that completes a stop
    string; among stops found then, the one starting first wins)."""
    for j in range(1, len(ids) + 1):
        text = tok.decode(ids[:j])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)]
    return tok.decode(ids)


# ---- UTF-8 -----------------------------------------------------------------------------------
def test_multibyte_characters_split_over_tokens_never_stream_replacement_char():
    text = "héllo 世界 🎉 𝄞!"
    data = text.encode()
    tok, ids = tokenize_bytes(text, list(range(1, len(data))))  # one token per byte: every char split
    assert any(FFFD in tok.decode([i]) for i in ids), "the test must really split characters"
    d, deltas = run(tok, ids)
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == text == d.text
    # each delta is whole characters: re-encoding it gives the bytes of whole tokens
    assert sum(len(x.encode()) for x in deltas) == len(data)


def test_incomplete_trailing_bytes_are_flushed_at_finish():
    # the request ends (length) in the middle of a character: the bytes are real output, so
    # finish() returns them (as U+FFFD, like tokenizer.decode of the whole output would).
    data = "ab世".encode()
    tok = ByteTokenizer([data[:2], data[2:4]])
    d = IncrementalDetokenizer(tok)
    assert d.add_token(0) == "ab"
    assert d.add_token(1) == ""          # held: incomplete character
    assert d.finish() == FFFD
    assert d.text == tok.decode([0, 1])


def test_special_tokens_are_skipped():
    tok = ByteTokenizer([b"Hi", b" there"], special={2: "<|im_end|>"})
    d, deltas = run(tok, [0, 1, 2])
    assert "".join(deltas) == "Hi there"


# ---- stop strings ----------------------------------------------------------------------------
def test_stop_string_spanning_three_tokens_is_never_emitted():
    tok = ByteTokenizer([b"Hel", b"lo, wo", b"rld", b"! more"])
    d = IncrementalDetokenizer(tok, ["o, world"])
    out = [d.add_token(0), d.add_token(1)]
    assert "".join(out) == "Hell"           # "o, wo" is held: it may start the stop string
    assert not d.stopped
    assert d.add_token(2) == ""              # completes "o, world": cut there
    assert d.stopped and d.stop_str == "o, world"
    assert d.text == "Hell"
    assert d.add_token(3) == "" and d.num_tokens == 3   # tokens after the stop are ignored
    assert d.finish() == ""


def test_held_stop_prefix_is_released_when_the_text_diverges():
    tok = ByteTokenizer([b"xab", b"d", b"ab"])
    d = IncrementalDetokenizer(tok, ["abc"])
    assert d.add_token(0) == "x"
    assert d.add_token(1) == "abd"
    assert d.add_token(2) == ""              # "ab" could still become "abc"
    assert d.finish() == "ab"                # the request ended for another reason: flush
    assert d.text == "xabdab" and not d.stopped


def test_earliest_of_several_stop_strings_wins_and_stop_at_start():
    tok = ByteTokenizer([b"one two three"])
    d, deltas = run(tok, [0], stop=["three", "two"])
    assert d.text == "one " and d.stop_str == "two"
    d, deltas = run(ByteTokenizer([b"STOP", b"x"]), [0, 1], stop=["STOP"])
    assert d.text == "" and d.stopped


def test_stop_string_before_a_split_character_matches_in_the_step_it_completes():
    # token 0 = " a" + the first byte of 世: "a" is complete after token 0, although the
    # decoded window ends in an incomplete character; the longer stop " a世" completes later.
    data = " a世".encode()
    tok = ByteTokenizer([data[:3], data[3:]])
    d = IncrementalDetokenizer(tok, ["a", " a世"])
    assert d.add_token(0) == " " and d.stopped and d.stop_str == "a"


def test_stop_string_inside_a_multibyte_split():
    text = "价格是：¥100。结束"
    data = text.encode()
    tok, ids = tokenize_bytes(text, list(range(1, len(data), 2)))
    d, deltas = run(tok, ids, stop=["。结"])
    assert "".join(deltas) == "价格是：¥100" and d.stopped
    assert all(FFFD not in x for x in deltas)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet="ab c世界🎉éx\n", min_size=0, max_size=24),
       cut_seed=st.integers(0, 2**32 - 1),
       stops=st.lists(st.text(alphabet="ab c世🎉x", min_size=1, max_size=4), max_size=3))
def test_property_stream_equals_whole_decode_cut_at_first_stop(text, cut_seed, stops):
    data = text.encode()
    rng = random.Random(cut_seed)
    cuts = [i for i in range(1, len(data)) if rng.random() < 0.5]
    if not data:
        return
    tok, ids = tokenize_bytes(text, cuts)
    d, deltas = run(tok, ids, stop=stops)
    want = expected(tok, ids, stops)
    assert "".join(deltas) == want == d.text
    assert all(FFFD not in x for x in deltas)
    assert d.stopped == any(s in text for s in stops)
    for s in stops:  # no emitted prefix ever contained a stop string
        assert s not in d.text


# ---- the real Qwen tokenizer -----------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_tok():
    from llmserve.tokenizer import load_tokenizer
    return load_tokenizer(None)


def test_real_tokenizer_split_characters(qwen_tok):
    text = "Music 𝄞 and robots 🤖🦾, 鿿 done"
    ids = qwen_tok.encode(text, add_special_tokens=False)
    assert any(FFFD in qwen_tok.decode([i]) for i in ids), "expected byte-fragment tokens"
    d, deltas = run(qwen_tok, ids)
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == text == qwen_tok.decode(ids)
    d, deltas = run(qwen_tok, ids, stop=["🦾,"])
    assert "".join(deltas) == "Music 𝄞 and robots 🤖"


def test_token_bytes_and_text_for_logprobs(qwen_tok):
    ids = qwen_tok.encode("𝄞", add_special_tokens=False)
    assert len(ids) == 2
    raw = b"".join(bytes(token_bytes(qwen_tok, i)) for i in ids)
    assert raw == "𝄞".encode()
    assert token_text(qwen_tok, ids[0]).startswith("bytes:\\x")
    assert token_text(qwen_tok, 9707) == "Hello"
    assert token_bytes(qwen_tok, 1879) == list(b" world")
