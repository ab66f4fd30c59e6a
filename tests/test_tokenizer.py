"""The built-in Qwen2 tokenizer: ids, special tokens, chat template, round-trips, tiktoken parity."""

from __future__ import annotations

import shutil
import unicodedata

import pytest

from llmserve.tokenizer import (
    CHATML_TEMPLATE,
    MARKER_FILE,
    QWEN2_PATTERN,
    SPECIAL_TOKENS,
    apply_chat_template,
    ensure_builtin_tokenizer_dir,
    load_tokenizer,
    qwen_tiktoken_file,
)

TRICKY = [
    "Hello world",
    "你好，世界！这是一个测试。",
    "emoji 🎉🚀👩‍👩‍👧 and flags 🇫🇷",
    "I'm here, you're there, they've gone; she'll say it's John's.",
    "numbers 1234567 3.14159 2024-11-29 and 00042",
    "  leading spaces\n\n\ttabs\r\nCRLF   trailing   ",
    "def f(x):\n    return x ** 2  # comment\n",
    "Ünïcödé ﬁ ligature and composed e\u0301 (NFC)",
    "<|im_start|> literal text between <|im_end|> specials<|endoftext|>",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_hello_world_ids(tok):
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert tok("Hello world")["input_ids"] == [9707, 1879]   # no BOS/EOS added


def test_special_tokens(tok):
    for text, tid in SPECIAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(text) == tid
        assert tok.encode(text, add_special_tokens=False) == [tid]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 151643
    assert tok.pad_token_id == 151643
    assert len(tok) == 151646
    user = tok.encode("user", add_special_tokens=False)
    assert tok.decode([151644, *user, 151645], skip_special_tokens=True) == "user"
    assert tok.decode([151644, *user, 151645]) == "<|im_start|>user<|im_end|>"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = apply_chat_template(tok, msgs)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.chat_template == CHATML_TEMPLATE
    assert apply_chat_template(tok, msgs, add_generation_prompt=False).endswith("Hi!<|im_end|>\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 151644 and ids.count(151645) == 2
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        apply_chat_template(tok, [{"role": "user"}])


def test_chat_template_fallback_without_template():
    class NoTemplate:
        chat_template = None
    assert apply_chat_template(NoTemplate(), [{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("text", TRICKY)
def test_roundtrip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_matches_tiktoken(tok):
    """Same ids as tiktoken with the Qwen ranks (the reference BPE) on tricky strings."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe
    enc = tiktoken.Encoding("qwen", pat_str=QWEN2_PATTERN,
                            mergeable_ranks=load_tiktoken_bpe(str(qwen_tiktoken_file())),
                            special_tokens=SPECIAL_TOKENS)
    for text in TRICKY:
        nfc = unicodedata.normalize("NFC", text)
        assert tok.encode(text, add_special_tokens=False) == enc.encode(nfc, allowed_special="all"), text


def test_memoised_and_tiny_dir_uses_builtin_files(tok, tiny_path, tmp_path):
    assert load_tokenizer() is tok
    tiny_tok = load_tokenizer(tiny_path)
    assert load_tokenizer(tiny_path) is tiny_tok
    assert tiny_tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    # a directory without tokenizer files falls back to the built-in tokenizer
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is tok
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


def test_saved_files_load_with_autotokenizer(tmp_path):
    """The cached files are a normal HF tokenizer directory (no llmserve marker -> AutoTokenizer)."""
    src = ensure_builtin_tokenizer_dir()
    for f in src.iterdir():
        if f.name != MARKER_FILE:
            shutil.copy2(f, tmp_path / f.name)
    auto = load_tokenizer(tmp_path)
    assert auto.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert auto.eos_token_id == 151643 and auto.convert_tokens_to_ids("<|im_end|>") == 151645
    assert apply_chat_template(auto, [{"role": "user", "content": "q"}]) == \
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
