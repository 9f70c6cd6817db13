"""Structured output through PD: every answer valid against its schema, and the grammar's cost.

    python -m benchmarks.structured                        # 100 schemas, a demo PD cluster
    python -m benchmarks.structured --count 6 --output ''  # smoke: print, write nothing
    python -m benchmarks.structured --url http://HOST:PORT # an already running router
    python -m benchmarks.structured --compare-libraries    # llguidance, outlines-core, xgrammar

Each request asks the demo model (greedy) for a JSON answer under its own schema from
`varied_schemas` (objects of bounded strings, enums, integer ranges, booleans, small arrays,
nested objects and nullable fields: the grammar can always finish within max_tokens), half of
them streamed; every answer must end with finish_reason "stop" and validate with `jsonschema`
(the exit status is 1 if one does not, and the table lists it). Interleaved with them, in
the same run, the same prompt without a schema (max_tokens as the schema's answer took,
ignore_eos) gives the plain inter-token latency the constrained one is compared with: ITL
is the mean gap between a stream's token events on D (after P's first token). The table also
gives the grammar's own CPU time per token in this process (mask for one row + advance,
llguidance on the demo tokenizer), which is what the difference should be made of, and the
cost of one request's matcher, which a worker pays at admission on its CPU threads.
Only the results section of --output is replaced; the prose around it stays.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from benchmarks.table_file import publish_section

MODEL = "demo"
PROMPT = "Answer with one JSON object that fits the schema."
SECTION = "structured-run"  # the results section of --output (the prose around it stays)


def varied_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """count different object schemas whose every answer is short (bounded everywhere)."""
    rng = random.Random(seed)
    return [_object_schema(rng, depth=0) for _ in range(count)]


def _object_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["id", "name", "kind", "size", "ok", "tags", "owner", "note", "level"], 3)
    props = {name: _value_schema(rng, depth) for name in names}
    return {"type": "object", "properties": props, "required": names,
            "additionalProperties": False}  # fmt: skip


def _value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kind = rng.choice(["string", "enum", "integer", "boolean", "array", "object", "nullable"])
    if kind == "object" and depth == 0:
        return _object_schema(rng, depth + 1)
    if kind == "array":
        return {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", 1, 2], 3)}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "nullable":
        return {"anyOf": [{"type": "null"}, {"type": "boolean"}]}
    return {"type": "string", "maxLength": rng.choice([4, 8, 12])}


def structured_body(schema: dict[str, Any], stream: bool, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    }


def _answer(
    client: httpx.Client, url: str, body: dict[str, Any]
) -> tuple[str, str | None, list[float]]:
    """The answer's text, finish_reason and (streamed) the times of its events with text."""
    if not body["stream"]:
        resp = client.post(f"{url}/v1/chat/completions", json=body)
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        return choice["message"]["content"] or "", choice["finish_reason"], []
    texts, times, finish = [], [], None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish = choice.get("finish_reason") or finish
            if choice["delta"].get("content"):
                texts.append(choice["delta"]["content"])
                times.append(time.perf_counter())
    return "".join(texts), finish, times


def invalid_reason(text: str, finish_reason: str | None, schema: dict[str, Any]) -> str | None:
    """Why an answer is not a complete JSON value of schema; None when it is."""
    import jsonschema

    if finish_reason != "stop":
        return f"finish_reason {finish_reason!r} (cut before the grammar completed)"
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return str(exc).splitlines()[0]
    return None


def _itl_s(times: list[float]) -> float | None:
    """The mean gap between token events after the first (the first gap is P's token to D's
    first: the handoff, not a decode step)."""
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]
    return statistics.fmean(gaps) if gaps else None


def run(url: str, count: int, max_tokens: int) -> dict[str, Any]:
    """Send the count requests, alternately whole and streamed, each streamed one followed by
    its plain twin (no schema, as many tokens, ignore_eos); validity and latencies."""
    sent = {"whole": 0, "streamed": 0}
    valid = {"whole": 0, "streamed": 0}
    failures: list[str] = []
    itl_schema: list[float] = []
    itl_plain: list[float] = []
    with httpx.Client(timeout=120) as client:
        for i, schema in enumerate(varied_schemas(count)):
            stream = i % 2 == 1
            mode = "streamed" if stream else "whole"
            text, finish, times = _answer(client, url, structured_body(schema, stream, max_tokens))
            sent[mode] += 1
            why = invalid_reason(text, finish, schema)
            if why is None:
                valid[mode] += 1
            else:
                failures.append(f"schema {i} ({mode}): {why}: {text[:80]!r}")
            if stream:
                plain = {**structured_body(schema, True, max(len(times), 3)),
                         "response_format": None, "ignore_eos": True}  # fmt: skip
                plain_times = _answer(client, url, plain)[2]
                for sink, t in ((itl_schema, times), (itl_plain, plain_times)):
                    if (itl := _itl_s(t)) is not None:
                        sink.append(itl)
    return {"count": count, "sent": sent, "valid": valid, "failures": failures,
            "itl_schema": itl_schema, "itl_plain": itl_plain}  # fmt: skip


def grammar_costs(num_tokens: int = 400) -> tuple[float, float]:
    """In this process, on the demo tokenizer: llguidance's mask (one row) + advance per token
    (us), and one request's matcher as a worker builds it at admission (ms)."""
    import numpy as np

    from workers.engine.grammar import Grammars, compile_json_schema, mask_logits
    from workers.engine.tokenizer import Tokenizer
    from workers.models.packaged import packaged_model_dir

    tokenizer = Tokenizer.from_dir(packaged_model_dir(MODEL))
    schema = varied_schemas(1)[0]
    answer = json.dumps(_an_answer(schema), separators=(",", ":"))
    token_ids = tokenizer.encode(answer)
    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    grammars.warm()
    grammar = compile_json_schema(json.dumps(schema))
    logits = np.zeros((1, tokenizer.vocab_size), dtype=np.float32)
    done, matcher_s = 0, []
    start = time.perf_counter()
    while done < num_tokens:
        built = time.perf_counter()
        matcher = grammars.matcher(grammar)
        matcher_s.append(time.perf_counter() - built)
        for token_id in token_ids:
            mask_logits(logits, [matcher])
            matcher.advance(token_id)
            done += 1
    per_token_s = (time.perf_counter() - start - sum(matcher_s)) / done
    return per_token_s * 1e6, statistics.median(matcher_s) * 1e3


def _an_answer(schema: dict[str, Any]) -> Any:
    """One valid value of a varied_schemas schema."""
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return None
    kind = schema["type"]
    if kind == "object":
        return {name: _an_answer(sub) for name, sub in schema["properties"].items()}
    return {"string": "abc", "integer": 7, "boolean": True, "array": ["a"]}[kind]


@contextmanager
def demo_cluster() -> Iterator[str]:
    """A demo PD cluster (1 P, 1 D, every prompt through P); its router URL while open."""
    from pdrouter.launch.cluster import Cluster
    from pdrouter.launch.spec import ClusterSpec

    spec = ClusterSpec(
        model=MODEL, num_prefill=1, num_decode=1, num_mixed=0, pool_size="256MiB",
        router_args=("--local-prefill-below-tokens", "0"),
        env=(("OMP_NUM_THREADS", "1"), ("MC_LOG_LEVEL", "ERROR"), ("GLOG_minloglevel", "2")),
        startup_timeout_s=240.0,
    )  # fmt: skip
    cluster = Cluster(spec)
    try:
        cluster.start()
        yield cluster.router_url
    finally:
        cluster.stop()


def table(result: dict[str, Any], costs: tuple[float, float], command: str) -> str:
    def ms(values: list[float]) -> str:
        return f"{1000 * statistics.median(values):.2f}" if values else "-"

    sent, valid = result["sent"], result["valid"]
    us_per_token, matcher_ms = costs
    lines = [
        f"`{command}` (demo model, greedy, through P and D; llguidance); load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        "| requests whole + streamed | valid against their schema | ITL with schema, median "
        "ms | ITL without, median ms | grammar CPU per token, us | matcher at admission, ms |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {sent['whole']} + {sent['streamed']} | {valid['whole']} + {valid['streamed']} | "
        f"{ms(result['itl_schema'])} | {ms(result['itl_plain'])} | {us_per_token:.0f} | "
        f"{matcher_ms:.2f} |",
    ]
    if result["failures"]:
        lines += ["", "Invalid answers:", "", *(f"- {f}" for f in result["failures"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--url", default="", help="a running router (default: start a cluster)")
    parser.add_argument(
        "--output",
        default="docs/benchmarks/structured.md",
        help="the file whose results section is replaced; '' prints only",
    )
    parser.add_argument(
        "--compare-libraries", action="store_true",
        help="only compare the grammar libraries (benchmarks.grammar_libraries); print it",
    )  # fmt: skip
    args = parser.parse_args()
    if args.compare_libraries:
        from benchmarks.grammar_libraries import compare

        print(compare())
        return 0
    command = f"python -m benchmarks.structured --count {args.count}"
    if args.url:
        result = run(args.url, args.count, args.max_tokens)
    else:
        with demo_cluster() as url:
            result = run(url, args.count, args.max_tokens)
    text = table(result, grammar_costs(), command)
    if args.output:
        publish_section(args.output, SECTION, text)
    else:
        print(text)
    # Every answer must be valid: a failure is the benchmark's finding, and its exit status.
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
