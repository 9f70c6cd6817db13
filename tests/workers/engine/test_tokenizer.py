"""Tokenizer over the tiny byte-level tokenizer.json: round trips, specials, chat templates,
and the incremental detokenizer across multi-byte UTF-8 boundaries."""

from __future__ import annotations

import json
import re

import pytest
from jinja2.exceptions import TemplateError

from workers.engine.tiny import write_byte_tokenizer
from workers.engine.tokenizer import PLAIN_CHAT_TEMPLATE, Tokenizer

TEXTS = [
    "hello world",
    "",
    "héllo wörld",
    "日本語のテキスト",
    "emoji 🎉🚀 and ZWJ 👩‍👩‍👧",
    "tabs\tnew\nlines\r\n  spaces  ",
    "mixed: ünïcödé ✓ Ω ß 中文 \x00 end",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer.from_dir(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_one_token_per_byte(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_special_tokens(tok):
    assert tok.vocab_size == 262
    assert tok.encode("<|user|>hi<|end|>") == [259, 104, 105, 261]
    assert tok.decode([259, 104, 105, 261]) == "hi"
    assert tok.decode([259, 104, 105, 261], skip_special_tokens=False) == "<|user|>hi<|end|>"
    assert tok.encode("hi", add_special_tokens=True) == [256, 104, 105]
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|eos|>"
    assert tok.token_to_id("<|assistant|>") == 260


def test_eos_ids_merge_config_and_tokenizer(folder):
    assert Tokenizer.from_dir(folder).eos_token_ids == (257,)
    assert Tokenizer.from_dir(folder, eos_token_ids=(261, 257)).eos_token_ids == (261, 257)


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<|bos|><|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n"
        "<|assistant|>\nhello<|end|>\n<|user|>\nab<|end|>\n<|assistant|>\n"
    )
    ids = tok.encode(text)
    assert ids[:3] == [256, 258, 10]
    assert ids[-2:] == [260, 10]
    no_prompt = tok.apply_chat_template(messages[:2], add_generation_prompt=False)
    assert no_prompt.endswith("hi<|end|>\n")


def test_message_without_role_rejected(tok):
    with pytest.raises(ValueError, match="message 1 has no 'role'"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"content": "y"}])


def test_plain_template_when_none_given(tmp_path, folder):
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == PLAIN_CHAT_TEMPLATE
    text = tok.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    )
    assert text == "system: s\nuser: q\nassistant: "


def test_named_template_list_and_raise_exception(tmp_path, folder):
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "tools"},
                    {"name": "default", "template": template},
                ],
                "eos_token": {"content": "<|eos|>", "special": True},
            }
        )
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (257,)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    with pytest.raises(TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_hf_template_helpers(tmp_path, folder):
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m | tojson }};{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "é<b>"}, {"role": "a", "content": "x"}, {"role": "b"}]
    assert tok.apply_chat_template(messages) == (
        '{"role": "user", "content": "é<b>"};{"role": "a", "content": "x"};4'
    )


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape("tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_never_splits_a_character(tok, text):
    detok = tok.new_detokenizer()
    deltas = [detok.push(i) for i in tok.encode(text)]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_holds_partial_bytes(tok):
    detok = tok.new_detokenizer()
    euro = list("€".encode())  # 3 bytes
    assert [detok.push(b) for b in [ord("a"), *euro, ord("b")]] == ["a", "", "", "€", "b"]
    assert detok.flush() == ""
    assert detok.token_ids == [97, *euro, 98]


def test_incremental_detokenizer_skips_specials_and_flushes_incomplete(tok):
    detok = tok.new_detokenizer()
    out = [detok.push(i) for i in [104, 261, 105, 0xE2, 0x82]]
    assert out == ["h", "", "i", "", ""]
    assert detok.flush() == "\ufffd"
    keep = tok.new_detokenizer(skip_special_tokens=False)
    assert [keep.push(i) for i in [104, 261]] == ["h", "<|end|>"]


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, ünïcödé text with accents",
    "日本語のテキストと中文的文本",
    "emoji 🎉🚀 party time",
] * 20


def _trained(kind: str) -> Tokenizer:
    """A small trained BPE in the style of real checkpoints: byte-level with merges (Llama 3,
    Qwen2) or SentencePiece-like Metaspace (Llama 2, Mistral)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if kind == "byte_level":
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        backend = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Sequence(
            [decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()]
        )
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return Tokenizer(backend, special_tokens={"eos_token": "</s>"})


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
@pytest.mark.parametrize(
    "text",
    [
        "the quick brown fox",
        "  leading and  double  spaces",
        "héllo 日本語 🎉 wörld",
        "ß Ω ✓ 中文 x",
    ],
)
def test_incremental_detokenizer_with_trained_tokenizers(kind, text):
    tok = _trained(kind)
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges happened
    detok = tok.new_detokenizer()
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
