"""ResponseFrame.chunk splices a token's text into cached bytes: the result must be exactly
what the pydantic models produce, for every kind of text a detokenizer can emit."""

from __future__ import annotations

import pytest

from pdrouter.wire.responses import ResponseFrame, _chunk_rest, encode_json_string

TEXTS = [" w5", "héllo", "日本語", "😀", 'q"uote', "back\\slash", "new\nline", "tab\t",
         "\x01\x1f", "\u2028\u2029", "\x7f", "</script>", "\x00text\x00"]  # fmt: skip


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("fingerprint", [None, "fp-1"])
def test_fast_chunk_is_byte_identical_to_the_models(endpoint: str, fingerprint: str | None) -> None:
    frame = ResponseFrame(endpoint, "req-1", "m", created=7, system_fingerprint=fingerprint)  # type: ignore[arg-type]
    for text in TEXTS:
        assert frame.chunk(text) == frame._model_chunk(text, None, False), repr(text)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("request_id", "model", "created"),
    [("req-1", "m", 7), ("r:2.x", "Qwen/Qwen2-7B", 1_790_000_000), ("id", "mödel \"q\"", 0),
     ("id", "has \x00text\x00 marker", 5), ("id", '"created":0,', 12)],
)  # fmt: skip
def test_every_kind_of_chunk_is_byte_identical_to_the_models(
    endpoint: str, request_id: str, model: str, created: int
) -> None:
    """First chunks (the role), final ones (a finish reason), empty texts, and frames whose
    model name holds the text marker or looks like a key: the same bytes as the models."""
    for fingerprint in (None, "fp-1"):
        frame = ResponseFrame(endpoint, request_id, model, created=created,  # type: ignore[arg-type]
                              system_fingerprint=fingerprint)  # fmt: skip
        for first in (True, False):
            for finish_reason in (None, "stop", "length"):
                for text in ("", " w1", *TEXTS):
                    got = frame.chunk(text, finish_reason, first)
                    assert got == frame._model_chunk(text, finish_reason, first), (
                        first, finish_reason, text
                    )  # fmt: skip
    chat = ResponseFrame("chat", "req-1", "m", created=7)
    assert b'"role":"assistant"' in chat.chunk("a", first=True)
    assert b'"delta":{}' in chat.chunk("")


def test_lone_surrogate_still_fails_as_before() -> None:
    frame = ResponseFrame("chat", "req-1", "m", created=7)
    with pytest.raises(ValueError):
        frame.chunk("\ud800")


def test_the_splice_is_used_unless_the_model_name_makes_it_ambiguous() -> None:
    assert _chunk_rest("chat", "m", None, False, None, True) is not None
    assert _chunk_rest("completions", "Qwen/Qwen2-7B", "fp", True, "stop", True) is not None
    assert _chunk_rest("chat", "m", None, False, "stop", False) is not None
    # Only a model named exactly like the marker makes the split ambiguous: the models then.
    assert _chunk_rest("chat", "\x00text\x00", None, False, None, True) is None
    frame = ResponseFrame("chat", "req-1", "\x00text\x00", created=7)
    assert frame.chunk(" w1") == frame._model_chunk(" w1", None, False)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("request_id", "model"), [("req-1", "m"), ("id", 'mödel "q"'), ("id", '"created":0,')]
)
def test_text_chunk_parts_splice_the_same_chunk(endpoint: str, request_id: str, model: str) -> None:
    """The relay's loop builds a text-only chunk from text_chunk_parts: byte for byte chunk()."""
    frame = ResponseFrame(endpoint, request_id, model, created=9, system_fingerprint="fp")  # type: ignore[arg-type]
    parts = frame.text_chunk_parts
    assert parts is not None
    for text in TEXTS:
        spliced = parts[0] + encode_json_string(text).encode() + parts[1]
        assert spliced == frame.chunk(text) == frame._model_chunk(text, None, False), repr(text)
    assert ResponseFrame("chat", "req-1", "\x00text\x00", created=7).text_chunk_parts is None


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_a_frame_whose_chunk_holds_text_has_no_splice(mode: str) -> None:
    """A tool-call frame holds (or rewrites) text deltas in its chunk(): the relay must not
    splice text around it, so it offers no parts."""
    from pdrouter.wire.tool_stream import chat_frame

    plain = ResponseFrame("chat", "req-1", "m", created=9)
    assert plain.text_chunk_parts is not None
    frame = chat_frame(plain, mode, None)
    assert frame is not plain and frame.text_chunk_parts is None
