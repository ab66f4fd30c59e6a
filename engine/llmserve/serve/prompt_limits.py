"""Bounded prompt tokenization: a prompt too long for its token limit is refused before it is
tokenized, or after tokenizing a prefix of it, never after seconds of tokenizer work.

Two proofs that a text has at least ``n`` tokens, both sound for byte-level BPE tokenizers
(GPT-2, Qwen2/Qwen2.5) whose normalizer is NFC or none:

1. **Characters** (:meth:`TokenBudget.lower_bound`). Every token covers at most ``M`` bytes of
   the normalized text (``M``: the longest vocabulary entry, in bytes, or added token, in
   characters; 128 for Qwen2), and a character is at least one byte, so a text whose NFC form
   has ``c`` characters has at least ``ceil(c / M)`` tokens. NFC shortens a text by at most
   the longest canonical decomposition of one code point (``NFC_MAX_SHRINK`` = 4, checked over
   all of Unicode by the tests: NFD(NFC(t)) = NFD(t) is at least as long as ``t``), so
   ``ceil(len(text) / (4 M))`` needs no normalization at all: O(1), used before a request
   reaches the tokenizer thread.
2. **Prefix** (:meth:`TokenBudget.encode`). Cut the text before an ASCII whitespace character
   (NFC never composes across it, and added tokens hold no whitespace) and tokenize the prefix.
   The pre-tokenizer's regex pieces of the prefix are those of the whole text except the ones
   reaching the cut (a piece is decided by its own characters and at most one character of
   look-ahead), and BPE merges inside a piece only, so the prefix's tokens outside its last two
   pieces are tokens of the whole text as well. Prefixes grow 4x per round, from
   ``8 x limit`` characters, so refusing costs at most a few tens of milliseconds of
   tokenization for ordinary text, and accepting at most 4/3 of one full tokenization.

Other tokenizers (no byte-level BPE, another normalizer) are tokenized in full: the request
body limit bounds that work.
"""

from __future__ import annotations

import threading
import unicodedata
from typing import Any

#: the most code points one code point decomposes into canonically (NFD) in Unicode, e.g.
#: U+1F82 (4); NFC shortens a text by at most this factor
NFC_MAX_SHRINK = 4

#: the first prefix tokenized, in characters per token of the limit
FIRST_PREFIX_CHARS_PER_TOKEN = 8

#: how far back from a prefix's target length a cut point (ASCII whitespace) is looked for
CUT_SEARCH_CHARS = 4096

_CUT_CHARS = frozenset(" \t\n\r\f\v")


class TooManyTokens(ValueError):
    """The text has at least :attr:`at_least` tokens, which reaches the limit it was given."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"at least {at_least} tokens (limit {limit})")
        self.at_least = at_least
        self.limit = limit


def _byte_level_bpe(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when it is a byte-level BPE with an NFC
    (or no) normalizer, else ``None``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        normalizer = backend.normalizer
        model = backend.model
        pre = backend.pre_tokenizer
    except Exception:  # noqa: BLE001 - not a tokenizers object
        return None
    if normalizer is not None and type(normalizer).__name__ != "NFC":
        return None
    if type(model).__name__ != "BPE" or pre is None or "ByteLevel" not in repr(pre):
        return None
    return backend


class TokenBudget:
    """Counts a tokenizer's tokens no further than a limit (module docstring).

    Args:
        tokenizer: an HF tokenizer (``encode``); the proofs apply when it wraps a byte-level BPE
            ``tokenizers.Tokenizer`` with an NFC or no normalizer, otherwise every text is
            tokenized in full.

    Thread-safe: the tokenizer is only read.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ready = False
        self._backend: Any = None
        self._max_piece: int | None = None

    def prepare(self) -> None:
        """Inspect the tokenizer once (its vocabulary: ~0.1 s for 150k entries); later calls
        are free. Called lazily by the other methods, or ahead of time off the event loop."""
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            backend = _byte_level_bpe(self.tokenizer)
            longest = None
            if backend is not None:
                try:
                    vocab = backend.get_vocab(with_added_tokens=True)
                    longest = max((len(t) for t in vocab), default=None)
                except Exception:  # noqa: BLE001 - no bound rather than a wrong one
                    longest = None
            self._backend = backend if longest else None
            self._max_piece = longest or None
            self._ready = True

    @property
    def max_chars_per_token(self) -> int | None:
        """``M``: the most characters (of NFC text) one token covers; ``None`` when unknown
        (then no text is refused before tokenizing). Only valid after :meth:`prepare`."""
        return self._max_piece if self._ready else None

    def quick_lower_bound(self, num_chars: int) -> int:
        """Tokens any text of ``num_chars`` characters has at least: ``ceil(num_chars /
        (NFC_MAX_SHRINK * M))``, 0 before :meth:`prepare` or without a bound. O(1)."""
        m = self.max_chars_per_token
        if not m or num_chars <= 0:
            return 0
        return -(-num_chars // (NFC_MAX_SHRINK * m))

    def lower_bound(self, text: str) -> int:
        """Tokens ``text`` has at least, from the length of its NFC form (O(len(text)), in C;
        no tokenization). 0 when the tokenizer gives no bound."""
        self.prepare()
        m = self._max_piece
        if not m or not text:
            return 0
        n = len(text) if unicodedata.is_normalized("NFC", text) else len(unicodedata.normalize("NFC", text))
        return -(-n // m)

    def encode(self, text: str, limit: int | None, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...)``, unless ``text`` is proven to have
        at least ``limit`` tokens first (``None``: no limit).

        Raises:
            TooManyTokens: the text has ``limit`` tokens or more (proven by its length or by a
                prefix, or counted).
            TypeError, UnicodeError, ValueError: as the tokenizer's ``encode``.
        """
        if limit is not None:
            self.prepare()
            proven = self.lower_bound(text) if self._max_piece and len(text) >= limit else 0
            if proven >= limit:
                raise TooManyTokens(proven, limit)
            if self._backend is not None:
                self._prefix_proof(text, limit)
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if limit is not None and len(ids) >= limit:
            raise TooManyTokens(len(ids), limit)
        return ids

    def _prefix_proof(self, text: str, limit: int) -> None:
        target = FIRST_PREFIX_CHARS_PER_TOKEN * max(1, limit)
        while target < len(text):
            cut = _cut_point(text, target)
            if cut is not None:
                proven = self._tokens_before_last_pieces(text[:cut])
                if proven >= limit:
                    raise TooManyTokens(proven, limit)
            target *= 4

    def _tokens_before_last_pieces(self, prefix: str) -> int:
        enc = self._backend.encode(prefix, add_special_tokens=False)
        words = enc.word_ids
        last: list = []
        for w in reversed(words):
            if w is not None and w not in last:
                last.append(w)
                if len(last) == 2:
                    break
        return max(0, sum(1 for w in words if w is None or w not in last) - 1)


def _cut_point(text: str, target: int) -> int | None:
    """The largest ``p <= target`` (at most ``CUT_SEARCH_CHARS`` below it) with ``text[p]`` ASCII
    whitespace, or ``None``."""
    stop = max(0, target - CUT_SEARCH_CHARS)
    for p in range(min(target, len(text) - 1), stop, -1):
        if text[p] in _CUT_CHARS:
            return p
    return None
