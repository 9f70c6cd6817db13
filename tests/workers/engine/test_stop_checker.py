"""StopChecker: stop tokens, stop strings with hold-back, length (no Paddle)."""

from __future__ import annotations

from tests.workers.engine.char_tokenizer import CharDetokenizer
from workers.engine.stop_checker import StopChecker, StopResult


def checker(stop=(), stop_token_ids=(), max_tokens=100, max_model_len=1000) -> StopChecker:
    return StopChecker(CharDetokenizer(), stop, stop_token_ids, max_tokens, max_model_len)


def feed(c: StopChecker, text: str, start_outputs: int = 0) -> list[StopResult]:
    return [c.append(ord(ch), 10 + i, start_outputs + i + 1) for i, ch in enumerate(text)]


def test_plain_text_passes_through() -> None:
    results = feed(checker(), "abc")
    assert results == [StopResult("a", None), StopResult("b", None), StopResult("c", None)]


def test_stop_string_is_cut_and_prefix_held_back() -> None:
    results = feed(checker(stop=("</s>",)), "hi</s>x")
    assert [r.text for r in results[:6]] == ["h", "i", "", "", "", ""]
    assert results[5].finish_reason == "stop"
    assert all(r.finish_reason is None for r in results[:5])


def test_held_text_released_when_the_stop_string_does_not_follow() -> None:
    results = feed(checker(stop=("ab",)), "aac")
    assert results == [StopResult("", None), StopResult("a", None), StopResult("ac", None)]


def test_stop_string_inside_one_token_keeps_text_before_it() -> None:
    class WordDetokenizer:
        def push(self, token_id: int) -> str:
            return {1: "say ", 2: "helloSTOPworld"}[token_id]

        def flush(self) -> str:
            return ""

    c = StopChecker(WordDetokenizer(), ("STOP",), (), 10, 100)
    assert c.append(1, 5, 1) == StopResult("say ", None)
    assert c.append(2, 6, 2) == StopResult("hello", "stop")


def test_earliest_of_several_stop_strings_wins() -> None:
    results = feed(checker(stop=("cd", "bcd")), "abcd")
    assert "".join(r.text for r in results) == "a"
    assert results[-1].finish_reason == "stop"


def test_stop_token_adds_no_text_and_releases_held_text() -> None:
    c = checker(stop=("xy",), stop_token_ids=(0,))
    assert c.append(ord("x"), 5, 1) == StopResult("", None)
    assert c.append(0, 6, 2) == StopResult("x", "stop")


def test_max_tokens_gives_length_and_releases_held_text() -> None:
    c = checker(stop=("zz",), max_tokens=2)
    assert c.append(ord("a"), 5, 1) == StopResult("a", None)
    assert c.append(ord("z"), 6, 2) == StopResult("z", "length")


def test_max_model_len_gives_length() -> None:
    c = checker(max_model_len=7)
    assert c.append(ord("a"), 6, 1) == StopResult("a", None)
    assert c.append(ord("b"), 7, 2) == StopResult("b", "length")


def test_stop_string_on_the_last_allowed_token_is_stop_not_length() -> None:
    c = checker(stop=("b",), max_tokens=2)
    assert c.append(ord("a"), 5, 1) == StopResult("a", None)
    assert c.append(ord("b"), 6, 2) == StopResult("", "stop")


def test_release_held_hands_over_pending_text() -> None:
    c = checker(stop=("ab",))
    assert c.append(ord("a"), 5, 1) == StopResult("", None)
    assert c.release_held() == "a"
    assert c.release_held() == ""


def test_stop_string_starting_in_text_emitted_before_a_handover() -> None:
    # Prefill released "</" when it handed over; the decode side was primed with it.
    c = checker(stop=("</s>",))
    c.prime([ord("<"), ord("/")])
    assert c.append(ord("s"), 5, 3) == StopResult("", None)  # held: "</s" may become "</s>"
    assert c.append(ord(">"), 6, 4) == StopResult("", "stop")


def test_stop_string_inside_the_primed_text_alone_is_not_a_new_stop() -> None:
    c = checker(stop=("ab",))
    c.prime([ord("a"), ord("b")])  # already seen by the client; not this engine's to stop
    assert c.append(ord("c"), 5, 3) == StopResult("c", None)


def test_emitted_tail_matches_only_stops_that_end_in_new_text() -> None:
    c = checker(stop=("xyz", "q"))
    assert [r.text for r in feed(c, "axy")] == ["a", "", ""]
    assert c.append(ord("w"), 20, 4) == StopResult("xyw", None)
    assert c.append(ord("q"), 21, 5) == StopResult("", "stop")


def test_stop_strings_count_only_after_min_tokens_outputs() -> None:
    c = StopChecker(CharDetokenizer(), ("b",), (), 100, 1000, min_tokens=2)
    # outputs 1 and 2 cannot stop (vLLM: a stop string counts from output min_tokens + 1 on)
    assert feed(c, "bb") == [StopResult("b", None), StopResult("b", None)]
    assert c.append(ord("b"), 12, 3) == StopResult("", "stop")


def test_first_token_finish_follows_the_same_min_tokens_rule() -> None:
    from workers.engine.api import SamplingParams
    from workers.prefill.stages import first_token_finish

    params = SamplingParams(max_tokens=5, stop=("b",))
    assert first_token_finish(ord("b"), "", params, (0,), lambda ids: "b") == ("stop", "")
    held = SamplingParams(max_tokens=5, stop=("b",), min_tokens=1)
    assert first_token_finish(ord("b"), "b", held, (0,), lambda ids: "b") == (None, "b")
