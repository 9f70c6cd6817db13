"""The grammar libraries compared on this machine: what installs, what a schema costs to
compile, and the token mask's cost per token, on the demo tokenizer (4096 tokens).

    python -m benchmarks.structured --compare-libraries

llguidance is a dependency; outlines-core is measured when installed
(`pip install outlines-core`); xgrammar is only inspected: its wheel requires torch,
transformers and triton, which this CPU server does not install. Each library walks the
same valid answer token by token: the allowed set at each step (llguidance: the bitmask;
outlines-core: the allowed token list), then the sampled token consumed.
"""

from __future__ import annotations

import importlib.util
import json
import time
from typing import Any

# What xgrammar 0.2.8's wheel requires (its METADATA), beyond numpy and pydantic.
XGRAMMAR_HEAVY_REQUIRES = ("torch>=1.10.0", "transformers>=4.38.0", "triton", "apache-tvm-ffi")


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, (time.perf_counter() - start) * 1e3


def llguidance_costs(tokenizer_json: str, eos: int, schema: str, ids: list[int], reps: int):
    import llguidance
    import llguidance.numpy as ll_numpy

    ll_tok, tok_ms = _timed(lambda: llguidance.LLTokenizer(tokenizer_json, eos_token=eos))
    grammar, grammar_ms = _timed(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema))
    matcher, matcher_ms = _timed(lambda: llguidance.LLMatcher(ll_tok, grammar))
    bitmask = ll_numpy.allocate_token_bitmask(1, ll_tok.vocab_size)
    start = time.perf_counter()
    for _ in range(reps):
        matcher.reset()
        for token_id in ids:
            ll_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
            matcher.consume_token(token_id)
    per_token_us = (time.perf_counter() - start) / (reps * len(ids)) * 1e6
    return tok_ms, grammar_ms + matcher_ms, per_token_us


def outlines_costs(backend: Any, eos: int, schema: str, ids: list[int], reps: int):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    vocab: dict[str, list[int]] = {}
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        if token_id != eos:
            vocab.setdefault(backend.id_to_token(token_id), []).append(token_id)
    vocabulary, vocab_ms = _timed(lambda: outlines_core.Vocabulary(eos, vocab))
    index, index_ms = _timed(
        lambda: outlines_core.Index(build_regex_from_schema(schema), vocabulary)
    )
    guide = outlines_core.Guide(index)
    start = time.perf_counter()
    for _ in range(reps):
        guide.reset()
        for token_id in ids:
            guide.get_tokens()
            guide.advance(token_id)
    per_token_us = (time.perf_counter() - start) / (reps * len(ids)) * 1e6
    return vocab_ms, index_ms, per_token_us


def compare(reps: int = 20) -> str:
    """The comparison as a Markdown section."""
    from tokenizers import Tokenizer as HFTokenizer

    from workers.models.packaged import packaged_model_dir

    backend = HFTokenizer.from_file(str(packaged_model_dir("demo") / "tokenizer.json"))
    eos = 1
    schema = json.dumps({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                "maxItems": 3},
                       "kind": {"enum": ["cat", "dog"]}},
        "required": ["name", "age", "tags", "kind"], "additionalProperties": False,
    })  # fmt: skip
    answer = '{"name":"Alice Smith","age":42,"tags":["a","c"],"kind":"dog"}'
    ids = backend.encode(answer, add_special_tokens=False).ids
    rows = ["| library | installs here | once per tokenizer, ms | per schema, ms | "
            "mask + advance per token, us |", "|---|---|---:|---:|---:|"]  # fmt: skip
    tok_ms, schema_ms, us = llguidance_costs(backend.to_str(), eos, schema, ids, reps)
    rows.append(
        f"| llguidance | wheel, no dependencies | {tok_ms:.0f} | {schema_ms:.2f} | {us:.0f} |"
    )
    if importlib.util.find_spec("outlines_core") is not None:
        tok_ms, schema_ms, us = outlines_costs(backend, eos, schema, ids, reps)
        rows.append(
            f"| outlines-core | wheel, no dependencies | {tok_ms:.0f} | {schema_ms:.1f} | "
            f"{us:.0f} |"
        )
    else:
        rows.append("| outlines-core | (not installed: `pip install outlines-core`) | | | |")
    needs = ", ".join(XGRAMMAR_HEAVY_REQUIRES)
    rows.append(f"| xgrammar | needs {needs} | | | |")
    return "\n".join(["## The grammar libraries", "",
                      f"A {len(ids)}-token answer of a 4-field schema, {reps} times.", "",
                      *rows, ""])  # fmt: skip
