"""ResponseFrame.chunk splices a token's text into cached bytes: the result must be exactly
what the pydantic models produce, for every kind of text a detokenizer can emit."""

from __future__ import annotations

import pytest

from pdrouter.responses import ResponseFrame

TEXTS = [" w5", "héllo", "日本語", "😀", 'q"uote', "back\\slash", "new\nline", "tab\t",
         "\x01\x1f", "\u2028\u2029", "\x7f", "</script>", "\x00text\x00"]  # fmt: skip


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("fingerprint", [None, "fp-1"])
def test_fast_chunk_is_byte_identical_to_the_models(endpoint: str, fingerprint: str | None) -> None:
    frame = ResponseFrame(endpoint, "req-1", "m", created=7, system_fingerprint=fingerprint)  # type: ignore[arg-type]
    for text in TEXTS:
        assert frame.chunk(text) == frame._model_chunk(text, None, False), repr(text)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_first_last_and_empty_chunks_take_the_model_path(endpoint: str) -> None:
    frame = ResponseFrame(endpoint, "req-1", "m", created=7)  # type: ignore[arg-type]
    assert frame.chunk("a", first=True) == frame._model_chunk("a", None, True)
    assert frame.chunk("a", "stop") == frame._model_chunk("a", "stop", False)
    assert frame.chunk("") == frame._model_chunk("", None, False)
    if endpoint == "chat":
        assert b'"role":"assistant"' in frame.chunk("a", first=True)
        assert b'"delta":{}' in frame.chunk("")


def test_lone_surrogate_still_fails_as_before() -> None:
    frame = ResponseFrame("chat", "req-1", "m", created=7)
    with pytest.raises(ValueError):
        frame.chunk("\ud800")
