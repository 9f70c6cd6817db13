"""The demo model's training pipeline, the parts that need no PyTorch: what the chats look like,
how answers are cut from docstrings, the split, the tokenizer, and that the shipped files and
the training defaults agree with what the card says was run."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from workers.engine.tokenizer import Tokenizer
from workers.models.packaged import packaged_model_dir
from workers.models.training.chat_format import CHAT_TEMPLATE, SPECIAL_TOKENS, ChatRenderer
from workers.models.training.chat_pairs import (
    conversations,
    qa_pairs,
    summary,
    topic_name,
    topic_summary,
)
from workers.models.training.corpus import records, split_of
from workers.models.training.stdlib_text import DocEntry, clean_rest
from workers.models.training.tokenizer_training import train_tokenizer
from workers.models.training.train import TrainConfig, lr_at

DEMO = packaged_model_dir("demo")
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What does len do?"},
]


def test_shipped_template_and_special_tokens_are_the_training_ones():
    config = json.loads((DEMO / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    tokenizer = Tokenizer.from_dir(DEMO)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4, 5]


def test_training_chats_are_what_the_server_renders():
    served = Tokenizer.from_dir(DEMO).apply_chat_template(MESSAGES)
    renderer = ChatRenderer()
    assert renderer.prompt(MESSAGES) == served
    assert served == (
        "<|bos|><|system|>\nAnswer briefly.<|end|>\n<|user|>\nWhat does len do?<|end|>\n"
        "<|assistant|>\n"
    )
    answer = {"role": "assistant", "content": "Return the number of items in a container."}
    assert renderer.conversation([*MESSAGES, answer]) == (
        served + "Return the number of items in a container.<|end|>\n"
    )
    with pytest.raises(ValueError, match="role 'tool'"):
        renderer.conversation([{"role": "tool", "content": "x"}])


def test_summary_cuts_the_first_paragraph_at_a_sentence():
    assert summary("Return the square root of x.") == "Return the square root of x."
    assert summary("Return the items in order\n\nMore detail.") == "Return the items in order."
    # A C docstring's signature line is skipped; a colon introducing a block is dropped.
    assert summary("chain(*iterables) --> chain object\n\nReturn a chain object, lazily.") == (
        "Return a chain object, lazily."
    )
    assert summary("Do the first thing. Then see the table below:") == "Do the first thing."
    long = "First sentence here. " + "word " * 100
    assert summary(long, max_chars=60) == "First sentence here."
    assert summary("x = 1") is None  # too short
    assert summary(">>> print('a long enough example line')") is None
    assert summary("[a, b, c, d, e, f, g, h, i, j, k, l, m]") is None


def test_topic_summary_skips_grammar_and_stops_at_code():
    text = (
        'The "if" statement\n******************\n\n'
        'The "if" statement is used for conditional execution:\n\n'
        '   if_stmt ::= "if" expression ":" suite\n\n'
        "It selects exactly one of the suites by evaluating the expressions one by one.\n\n"
        "   if x:\n       pass\n\n"
        "Something after the code."
    )
    # The grammar block is skipped (little prose so far), the code block ends the answer.
    assert topic_summary(text) == (
        'The "if" statement is used for conditional execution. '
        "It selects exactly one of the suites by evaluating the expressions one by one."
    )
    assert topic_name('The "if" statement') == 'the "if" statement'
    assert topic_name("Boolean operations") == "Boolean operations"


def test_clean_rest_drops_roles():
    assert clean_rest("See :func:`json.dumps` and :py:class:`~a.B`.") == "See json.dumps and a.B."
    assert clean_rest("Use ``x`` here.") == "Use `x` here."


def test_qa_pairs_are_stable_and_conversations_keep_pairs_in_order():
    entries = [
        DocEntry("json", "json", "module", "JSON encoder and decoder."),
        DocEntry("json", "json.dumps", "function", "Serialize obj to a JSON string.", "(obj)"),
        DocEntry("json", "json", "comments", "not a question " * 10),
    ]
    pairs = list(qa_pairs(entries, seed=0))
    assert pairs == list(qa_pairs(entries, seed=0))
    assert [p.answer for p in pairs] == [
        "JSON encoder and decoder.",
        "JSON encoder and decoder.",
        "Serialize obj to a JSON string.",
    ]
    assert len({p.question for p in pairs[:2]}) == 2  # two phrasings for a module
    assert "json.dumps" in pairs[2].question
    chats = list(conversations(pairs, seed=0))
    answers = [m["content"] for _, msgs in chats for m in msgs if m["role"] == "assistant"]
    assert answers == [p.answer for p in pairs]


def test_records_wrap_documents_and_render_chats():
    doc = "Serialize obj to a JSON formatted str."
    entry = DocEntry("json", "json.dumps", "function", doc, "(obj)")
    rows = list(records([entry], seed=0))
    assert rows[0] == {
        "source": "json",
        "kind": "text",
        "text": f"<|bos|>json.dumps(obj)\n\n{doc}<|eos|>",
    }
    chats = [r for r in rows if r["kind"] == "chat"]
    assert chats[0]["text"].startswith("<|bos|>")
    assert chats[0]["text"].endswith(f"<|assistant|>\n{doc}<|end|>\n")
    assert {r["source"] for r in chats} == {"json", "identity"}


def test_split_is_a_pure_function_of_the_module_name():
    assert split_of("identity") == "train"
    assert split_of("copy") == "val" and split_of("json") == "train"
    assert [split_of(f"m{i}") for i in range(200)].count("val") == 6


def test_tokenizer_training_puts_special_tokens_first_and_round_trips():
    texts = ["<|bos|>Return the square root of x.<|eos|>"] * 20 + ["héllo wörld 🎉"] * 5
    tok = train_tokenizer(texts, vocab_size=300)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4, 5]
    assert 262 < tok.get_vocab_size() <= 300  # merges run out on so little text
    ids = tok.encode("<|user|>\nhéllo 🎉<|end|>", add_special_tokens=False).ids
    assert ids[0] == 3 and ids[-1] == 5
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>\nhéllo 🎉<|end|>"
    assert tok.encode("ab", add_special_tokens=True).ids[0] == 0  # bos prepended


def test_training_defaults_are_the_shipped_run():
    shipped = json.loads((DEMO / "train_result.json").read_text())["config"]
    defaults = asdict(TrainConfig())
    # The time limit is a safety net that the shipped run never reached (103 s of 110 s).
    assert {k: v for k, v in defaults.items() if k != "time_limit_s"} == {
        k: v for k, v in shipped.items() if k != "time_limit_s"
    }
    config = json.loads((DEMO / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        defaults["num_layers"],
        defaults["hidden_size"],
        defaults["intermediate_size"],
    )


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=1000, warmup_steps=100, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-5)
    assert lr_at(99, cfg) == pytest.approx(1e-3)
    assert lr_at(550, cfg) == pytest.approx(0.55e-3)
    assert lr_at(1000, cfg) == pytest.approx(1e-4)
