"""The router benchmark's pieces run: the mock backend speaks each protocol exactly, and real
processes (two mocks, both bare relays, our router on two clients, the vLLM toy proxy) carry
whole streams.
No timing asserts."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.router import path as bench_router_path
from benchmarks.router import upstream as bench_upstream
from benchmarks.router.bench_router import Bench, CaseStats, Phase, group_cpu_s
from benchmarks.router.load import LoadResult, StreamBroken, run_interleaved, run_load
from benchmarks.router.mock_backend import MockBackend, MockConfig, token_text
from benchmarks.router.report import markers, write_report
from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from pdrouter.wire.pd import DecodeEvent, PrefillResult
from tests.sse import sse_data


def _mock_client(role: str) -> httpx.AsyncClient:
    app = MockBackend(MockConfig(role=role))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock")


async def test_mock_prefill_answers_a_valid_result_with_the_first_token() -> None:
    async with _mock_client("prefill") as client:
        body = {"prompt": "x" * 62, "max_tokens": 5}  # json.dumps -> 64 chars -> 16 tokens
        resp = await client.post("/internal/prefill", json={"request_id": "r1", "body": body})
    assert resp.status_code == 200
    result = PrefillResult.model_validate(resp.json())
    assert result.request_id == "r1"
    assert result.prompt_token_ids == list(range(1, 17))
    assert (result.first_token_id, result.first_text, result.finish_reason) == (1000, " w0", None)
    assert result.kv is not None and len(result.kv.keys) == 1 and result.kv.num_tokens == 16


async def test_mock_decode_streams_the_tokens_after_those_already_sent() -> None:
    req = {"request_id": "r1", "body": {"max_tokens": 5}, "output_token_ids": [1000, 1001]}
    async with _mock_client("decode") as client:
        resp = await client.post("/internal/decode", json=req)
    events = [DecodeEvent.model_validate_json(d) for d in sse_data(resp)]
    assert [ev.token_ids for ev in events] == [[1002], [1003], [1004]]
    assert [ev.text for ev in events] == [" w2", " w3", " w4"]
    assert [ev.num_output_tokens for ev in events] == [3, 4, 5]
    assert [ev.finished for ev in events] == [False, False, True]
    assert events[-1].finish_reason == "length"


@pytest.mark.parametrize(("role", "num_tokens"), [("decode", 4), ("prefill", 1)])
async def test_mock_openai_stream_chat(role: str, num_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with _mock_client(role) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    data = sse_data(resp)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert [d["content"] for d in deltas] == [token_text(k) for k in range(num_tokens)]
    assert deltas[0]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == num_tokens


async def test_mock_openai_non_streamed_completion_and_probes() -> None:
    async with _mock_client("decode") as client:
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        health = await client.get("/health")
        info = await client.get("/get_server_info")
        missing = await client.post("/nowhere", json={})
    assert resp.json()["choices"][0]["text"] == " w0 w1 w2"
    assert health.json()["fingerprint"] == "mock-fingerprint"
    assert info.json()["disaggregation_mode"] == "decode"
    assert missing.status_code == 404


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    """Both mocks, our router and the toy proxy as real processes (the benchmark's own setup)."""
    cases = ["direct", "bare", "bare-raw", "pdrouter", "pdrouter-aiohttp", "toy"]
    b = Bench(tmp_path_factory.mktemp("bench-router"), cases)
    try:
        b.start()
        yield b
    finally:
        b.stop()


@pytest.mark.parametrize(
    "case", ["direct", "bare", "bare-raw", "pdrouter", "pdrouter-aiohttp", "toy"]
)
async def test_streams_arrive_whole_through_each_case(bench: Bench, case: str) -> None:
    assert case in bench.cases, bench.notes
    load = await run_load(bench.urls[case], "mock", 4, 8, window_s=0.0, num_requests=12)
    assert len(load.latencies_s) == 12 and len(load.ttfts_s) == 12
    assert all(0 < t <= lat for t, lat in zip(load.ttfts_s, load.latencies_s, strict=True))


async def test_a_damaged_stream_fails_the_run(bench: Bench) -> None:
    # The prefill mock answers one token where eight were asked: the check must catch it.
    with pytest.raises(StreamBroken, match="expected 8 tokens, got 1"):
        await run_load(bench.urls["mock-prefill"], "mock", 1, 8, window_s=0.0, num_requests=1)


def test_mock_backend_cli_serves_health(tmp_path: Path) -> None:
    port = find_free_port()
    argv = [sys.executable, "-m", "benchmarks.router.mock_backend", "--role", "prefill",
            "--port", str(port)]  # fmt: skip
    proc = ManagedProcess("mock", argv, log_path=tmp_path / "mock.log")
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", 30.0, proc)
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["role"] == "prefill"
    finally:
        proc.stop()


def test_group_cpu_counts_this_process_group() -> None:
    assert group_cpu_s(os.getpgid(0)) > 0.0
    assert group_cpu_s(2**22 + 7) == 0.0  # no such group


def test_report_keeps_hand_written_text_around_the_markers(tmp_path: Path) -> None:
    out = tmp_path / "router.md"
    BEGIN, END = markers("default")
    out.write_text(f"# Title\n\nintro\n\n{BEGIN}\nold table\n{END}\n\n## Analysis\nkept\n")
    stats = {Phase(16, 32): {"pdrouter": CaseStats(), "sglang": CaseStats()}}
    stats[Phase(16, 32)]["pdrouter"].latencies_s = [0.010] * 30
    stats[Phase(16, 32)]["pdrouter"].elapsed_s = 1.0
    stats[Phase(16, 32)]["sglang"].latencies_s = [0.010] * 20
    stats[Phase(16, 32)]["sglang"].elapsed_s = 1.0
    args = argparse.Namespace(rounds=1, window_s=1.0, section="default")
    write_report(stats, {}, args, 1.0, (0.1, 0.1, 0.1), (0.2, 0.2, 0.2), str(out))
    text = out.read_text()
    assert text.startswith("# Title\n\nintro\n\n" + BEGIN)
    assert text.endswith(END + "\n\n## Analysis\nkept\n")
    assert "old table" not in text
    assert "| pdrouter | 30 | 30.0 | 10.00 | 10.00 |" in text
    assert "pdrouter / sglang requests/s = 1.50x (target >= 1.0x): met." in text
    # Another section is appended, and the first one stays.
    write_report(stats, {}, argparse.Namespace(rounds=2, window_s=1.0, section="uvloop"), 1.0,
                 (0.1, 0.1, 0.1), (0.2, 0.2, 0.2), str(out))  # fmt: skip
    both = out.read_text()
    assert both.startswith(text.rstrip("\n"))
    assert both.count("| pdrouter | 30 |") == 2 and markers("uvloop")[0] in both


def test_upstream_benchmark_runs_every_client(tmp_path: Path) -> None:
    out = tmp_path / "upstream.md"
    assert bench_upstream.main(["--calls", "5", "--rounds", "1", "--output", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| h1", "| aiohttp"]
    assert all(len(row.split(" | ")) == 5 for row in rows)


def test_report_names_the_pacing_and_the_cases_of_a_run(tmp_path: Path) -> None:
    stats = {Phase(1, 32): {"direct": CaseStats(), "pdrouter": CaseStats()}}
    args = argparse.Namespace(rounds=1, window_s=1.0, section="paced", token_interval_ms=2.0,
                              cases=["direct", "pdrouter"])  # fmt: skip
    text = write_report(stats, {}, args, 1.0, (0.1,) * 3, (0.2,) * 3, None)
    assert ("`python -m benchmarks.router.bench_router --rounds 1 --window-s 1.0 --section paced "
            "--token-interval-ms 2 --cases direct pdrouter`") in text  # fmt: skip


async def test_interleaved_one_at_a_time_gives_every_case_the_same_turns(bench: Bench) -> None:
    urls = {case: bench.urls[case] for case in ("direct", "bare", "pdrouter")}

    def cpu(case: str) -> float | None:
        return None if case == "direct" else group_cpu_s(bench.procs[case].pid)

    loads = await run_interleaved(urls, "mock", 8, window_s=0.3, cpu=cpu)
    counts = {case: len(load.latencies_s) for case, load in loads.items()}
    assert len(set(counts.values())) == 1 and counts["direct"] > 0, counts
    for case, load in loads.items():
        assert load.elapsed_s == pytest.approx(sum(load.latencies_s))
        assert (load.cpu_s is None) == (case == "direct")
    assert loads["pdrouter"].cpu_s is not None and loads["pdrouter"].cpu_s > 0


def test_report_shows_no_cpu_figure_where_none_was_measured() -> None:
    stats = {Phase(1, 32): {"direct": CaseStats(), "pdrouter": CaseStats()}}
    direct, ours = stats[Phase(1, 32)]["direct"], stats[Phase(1, 32)]["pdrouter"]
    direct.add(LoadResult([0.001] * 4, [0.0005] * 4, 0.004), None)
    ours.add(LoadResult([0.002] * 4, [0.001] * 4, 0.008), 0.004)
    args = argparse.Namespace(rounds=1, window_s=1.0, section="default")
    text = write_report(stats, {}, args, 1.0, (0.1,) * 3, (0.2,) * 3, None)
    assert "| direct | 4 | 1000.0 | 1.00 | 1.00 | 0.50 | n/a |" in text
    assert "| pdrouter | 4 | 500.0 | 2.00 | 2.00 | 1.00 | 1.00 |" in text


async def test_router_path_benchmark_times_every_segment_of_a_request() -> None:
    total_us, cpu_us, segments_us = await bench_router_path.measure(
        20,
        8,
        serving_gc=False,  # the collector as pytest runs it: serving settings are global
    )
    assert total_us > 0 and cpu_us > 0
    assert list(segments_us) == [
        "router_accept -> prefill_sent",
        "prefill_sent -> prefill_done",
        "prefill_done -> disaggregation",
        "disaggregation -> first_token_sent",
        "first_token_sent -> decode_sent",
        "decode_sent -> first_decode_token",
        "first_decode_token -> second_token_sent",
        "second_token_sent -> end",
    ]
    assert sum(segments_us.values()) <= total_us
