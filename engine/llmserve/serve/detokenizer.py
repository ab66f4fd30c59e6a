"""Incremental detokenization with character-level stop strings.

A byte-level BPE token (Qwen2's tokenizer) is a run of *bytes*, not characters: one Chinese
character or emoji can be split over two or three tokens. Decoding a prefix that ends inside a
character gives U+FFFD (the replacement character). Streaming therefore holds back text until
it decodes cleanly, and holds back a suffix that could still grow into a stop string; both are
flushed when the request ends for another reason.

The decoding window follows vLLM's ``detokenize_incrementally`` (prefix_offset / read_offset):
decode ``ids[prefix_offset:]`` against ``ids[prefix_offset:read_offset]`` and emit the
difference, so each step decodes a few tokens instead of the whole output (O(1) per token).

Stop strings match on characters (OpenAI semantics): a match may span token boundaries, the
stop string and everything after it are never emitted, and the finish reason is ``stop``.

Invariant (tested): for any token sequence, the concatenation of every delta returned by
:meth:`IncrementalDetokenizer.add_token` plus :meth:`IncrementalDetokenizer.finish` equals
``tokenizer.decode(ids)`` cut at the first stop string.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"


def decode_tokens(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode`` without tokenization-space clean-up (which would make window
    decoding disagree with whole-sequence decoding). Works with HF tokenizers and test fakes."""
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)
    except TypeError:  # a minimal tokenizer without those keywords
        return tokenizer.decode(list(ids))


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string
    (the text that must be held back because the next token may complete a stop string)."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """Turns a stream of token ids into safe-to-emit text deltas.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=..., ...) -> str``.
        stop: stop strings (non-empty); matched on characters across token boundaries.
        skip_special_tokens: drop special tokens such as ``<|im_end|>`` from the text.

    Attributes:
        text: all text emitted so far (never contains a stop string).
        token_ids: every token id fed in (including the one that completed a stop string).
        stopped: a stop string matched; further tokens are ignored.
        stop_str: the stop string that matched, or None.
    """

    def __init__(self, tokenizer: Any, stop: Iterable[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""               # emitted
        self._pending = ""           # decoded but held back (possible stop-string prefix)
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text: str | None = None
        self._window_chars = 0
        self.stopped = False
        self.stop_str: str | None = None
        self.finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_decoded_chars(self) -> int:
        """Characters decoded so far, emitted or held back (a split character counts once it
        completes): where the next token's text begins."""
        return len(self.text) + len(self._pending)

    def _decode(self, ids: Sequence[int]) -> str:
        return decode_tokens(self.tokenizer, ids, self.skip_special_tokens)

    def _decode_window(self, final: bool) -> str:
        """Text that became final since the last call.

        The window ``ids[read_offset:]`` holds the tokens since the last clean character
        boundary; ``ids[prefix_offset:read_offset]`` is decoded with it as context (so
        tokenizers that drop a leading space at the start of a decode still diff correctly).
        Characters before a trailing run of U+FFFD are final (later bytes can only complete or
        replace that run), so they are released at once: a stop string that ends just before
        a split character is seen in the step that completed it. The run itself is held until
        the character completes, or released as is when ``final``.
        """
        ids = self.token_ids
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        new = full[len(self._prefix_text):]  # byte-level decoding is prefix-stable at char boundaries
        clean = not new.endswith(REPLACEMENT_CHAR)
        stable = new if (final or clean) else new.rstrip(REPLACEMENT_CHAR)
        delta = stable[self._window_chars:] if len(stable) > self._window_chars else ""
        self._window_chars = max(self._window_chars, len(stable))
        if clean or final:  # a character boundary: the window becomes the next context
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self._prefix_text = new
            self._window_chars = 0
        return delta

    def _release(self, final: bool) -> str:
        """Check stop strings in the held text and return what may be emitted now."""
        pending = self._pending
        if self.stop and pending:
            # A match can only start in the held-back region: everything emitted earlier was
            # checked not to begin any stop string.
            hit, hit_stop = -1, None
            for s in self.stop:
                i = pending.find(s)
                if i != -1 and (hit == -1 or i < hit):
                    hit, hit_stop = i, s
            if hit != -1:
                out = pending[:hit]
                self._pending = ""
                self.text += out
                self.stopped = True
                self.stop_str = hit_stop
                return out
        hold = 0 if final or not self.stop else _longest_stop_prefix_suffix(pending, self.stop)
        out = pending[:len(pending) - hold]
        self._pending = pending[len(pending) - hold:]
        self.text += out
        return out

    def add_token(self, token_id: int) -> str:
        """Feed one token id; returns the text that can be emitted now ('' if held back).

        After a stop string matched (``stopped``), tokens are ignored and '' is returned.
        """
        if self.stopped or self.finished:
            return ""
        self.token_ids.append(int(token_id))
        self._pending += self._decode_window(final=False)
        return self._release(final=False)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Feed several ids one by one (stopping at a stop string); returns the joined delta."""
        parts = []
        for t in token_ids:
            if self.stopped:
                break
            parts.append(self.add_token(t))
        return "".join(parts)

    def finish(self) -> str:
        """The request ended (EOS, length, abort): flush held-back text. A stop string can
        still match in it (then the text is cut there and ``stopped`` becomes True)."""
        if self.stopped or self.finished:
            self.finished = True
            return ""
        self._pending += self._decode_window(final=True)
        out = self._release(final=True)
        self.finished = True
        return out


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """The UTF-8 bytes one token stands for (OpenAI's ``bytes`` field of chat logprobs).

    Byte-level BPE vocabularies store bytes as printable characters (GPT-2's
    ``bytes_to_unicode`` table); this inverts that table. Other tokens fall back to the UTF-8
    encoding of their decoded text.
    """
    try:
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
    except Exception:  # noqa: BLE001 - fakes or ids unknown to the tokenizer
        piece = None
    if isinstance(piece, str):
        table = _byte_decoder()
        if piece and all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
    return list(decode_tokens(tokenizer, [token_id], skip_special_tokens=False).encode("utf-8"))


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (the byte-level BPE alphabet)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
            + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


def token_text(tokenizer: Any, token_id: int) -> str:
    """Display text of one token for logprobs: its decoded text, or ``bytes:\\xNN..`` when the
    token is part of a multi-byte character (OpenAI's convention for such tokens)."""
    text = decode_tokens(tokenizer, [token_id], skip_special_tokens=False)
    if REPLACEMENT_CHAR in text:
        raw = token_bytes(tokenizer, token_id)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text
