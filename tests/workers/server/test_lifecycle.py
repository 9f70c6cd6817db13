"""Worker lifecycle: 503 while the model loads, 503 + Retry-After when full, 503 once the engine
is dead, exit code 1 when the model cannot load.

The first three run the app in this process (uvicorn in a thread, the real AsyncEngine on the
tiny model) because they need a hand on the engine: its construction is held at a gate to
observe "loading", and it is shut down for real to observe "dead".
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from pdrouter.common.proc import ManagedProcess, find_free_port
from tests.repo import REPO_ROOT
from tests.sse import DONE, iter_sse_data
from tests.wait import wait_until
from tests.workers.server.conftest import start_worker, worker_env
from workers.server.app import create_app
from workers.server.config import AppConfig

LOAD_TIMEOUT_S = 120.0


class InProcessWorker:
    """create_app + uvicorn in a daemon thread; stop() ends the server and the engine."""

    def __init__(self, engine_factory: Callable[[], object], max_pending_requests: int) -> None:
        config = AppConfig("mixed", ("tiny",), max_pending_requests=max_pending_requests)
        self.app = create_app(config, engine_factory)
        port = find_free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        wait_until(
            lambda: self.server.started or not self.thread.is_alive(), 30, "uvicorn to start"
        )
        assert self.server.started, "uvicorn's thread ended before it started serving"

    def wait_ready(self) -> None:
        wait_until(
            lambda: httpx.get(f"{self.base_url}/health", timeout=5).status_code,
            LOAD_TIMEOUT_S,
            "the engine to load (/health 200)",
            done=lambda status: status == 200,
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "uvicorn thread did not stop"


@pytest.fixture(scope="module")
def engine_factory(tiny_cache_dir: Path) -> Callable[[], object]:
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.engine_config import EngineConfig

    config = EngineConfig(model="tiny", block_size=16, num_kv_blocks=64, max_model_len=512,
                          cache_dir=str(tiny_cache_dir))  # fmt: skip
    return lambda: AsyncEngine.from_config(config)


def _gated_worker(
    engine_factory: Callable[[], object],
) -> Iterator[tuple[InProcessWorker, threading.Event]]:
    gate = threading.Event()

    def gated_factory() -> object:
        assert gate.wait(LOAD_TIMEOUT_S), "the test never opened the gate"
        return engine_factory()

    worker = InProcessWorker(gated_factory, max_pending_requests=1)
    try:
        yield worker, gate
    finally:
        gate.set()
        worker.stop()


@pytest.fixture()
def loading_worker(
    engine_factory: Callable[[], object],
) -> Iterator[tuple[InProcessWorker, threading.Event]]:
    """A worker of its own whose engine is held at the gate: "loading" is seen in any test order."""
    yield from _gated_worker(engine_factory)


@pytest.fixture(scope="module")
def gated_worker(
    engine_factory: Callable[[], object],
) -> Iterator[tuple[InProcessWorker, threading.Event]]:
    yield from _gated_worker(engine_factory)


def test_503_while_loading_then_ready(
    loading_worker: tuple[InProcessWorker, threading.Event],
) -> None:
    worker, gate = loading_worker
    assert not gate.is_set()
    health = httpx.get(f"{worker.base_url}/health", timeout=5)
    assert health.status_code == 503
    assert health.headers["retry-after"] == "2"
    assert health.json() == {"status": "loading", "role": "mixed"}
    early = httpx.post(f"{worker.base_url}/v1/completions", timeout=5,
                       json={"model": "tiny", "prompt": "x", "max_tokens": 1})  # fmt: skip
    assert early.status_code == 503
    assert early.headers["retry-after"] == "2"
    assert early.json()["error"]["code"] == "not_ready"
    assert early.json()["error"]["type"] == "service_unavailable"
    metrics = httpx.get(f"{worker.base_url}/metrics", timeout=5).text
    assert "pdworker_engine_ready 0.0" in metrics
    gate.set()
    worker.wait_ready()
    assert "pdworker_engine_ready 1.0" in httpx.get(f"{worker.base_url}/metrics", timeout=5).text


def test_full_server_answers_503_with_retry_after(
    gated_worker: tuple[InProcessWorker, threading.Event],
) -> None:
    worker, gate = gated_worker
    gate.set()
    worker.wait_ready()
    url = f"{worker.base_url}/v1/completions"
    long_body = {"model": "tiny", "prompt": "hold", "max_tokens": 400, "ignore_eos": True,
                 "stream": True}  # fmt: skip
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=long_body) as held:
        assert held.status_code == 200
        events = iter_sse_data(held)  # kept: dropping it would close the stream
        assert json.loads(next(events))["choices"]  # admitted and generating
        refused = httpx.post(url, json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                             timeout=30)  # fmt: skip
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
    # The held stream is closed: its slot is free again.
    ok = wait_until(
        lambda: httpx.post(url, json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=30),
        30,
        "the held stream's slot to be free again",
        done=lambda r: r.status_code == 200,
    )
    assert ok.json()["usage"]["completion_tokens"] == 1


def test_dead_engine_answers_503(engine_factory: Callable[[], object]) -> None:
    worker = InProcessWorker(engine_factory, max_pending_requests=8)
    try:
        worker.wait_ready()
        url = f"{worker.base_url}/v1/completions"
        body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as resp:
            events = iter_sse_data(resp)
            assert json.loads(next(events))["choices"]  # a first token
            # The engine dies mid-stream: the 200 is out, so the error comes in-band.
            worker.app.state.worker.engine.shutdown()
            rest = list(events)
        assert rest[-1] == DONE
        assert json.loads(rest[-2])["error"]["type"] == "server_error"
        health = httpx.get(f"{worker.base_url}/health", timeout=5)
        assert health.status_code == 503
        assert health.json()["status"] == "failed"
        resp = httpx.post(
            f"{worker.base_url}/v1/chat/completions",
            timeout=30,
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        )
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "engine_failed"
    finally:
        worker.stop()


def test_unloadable_model_exits_with_code_1(tmp_path: Path, tiny_cache_dir: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "workers.cli",
        "serve",
        "--role",
        "mixed",
        "--model",
        str(tmp_path / "no-such-checkpoint"),
        "--port",
        str(find_free_port()),
    ]
    proc = ManagedProcess("pdworker-bad-model", argv, env=worker_env(tiny_cache_dir),
                          log_path=tmp_path / "worker.log",
                          cwd=str(REPO_ROOT))  # fmt: skip
    try:
        proc.popen.wait(timeout=LOAD_TIMEOUT_S)
    finally:
        proc.stop()
    assert proc.returncode == 1
    assert "is neither a tiny preset nor a checkpoint folder" in proc.log_tail()


def test_sigterm_shuts_down_gracefully(tmp_path: Path, tiny_cache_dir: Path) -> None:
    handle = start_worker(tmp_path, tiny_cache_dir, name="pdworker-sigterm")
    assert handle.proc is not None
    try:
        ok = httpx.post(f"{handle.api_url}/completions", timeout=60,
                        json={"model": "tiny", "prompt": "x", "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200
    finally:
        # SIGTERM first: uvicorn's handler (not Paddle's abort) must run the lifespan shutdown.
        returncode = handle.proc.stop()
    log = handle.proc.log_tail()
    assert "Application shutdown complete" in log
    assert "SIGTERM (@" not in log, "Paddle's failure handler caught SIGTERM"
    # After its graceful shutdown uvicorn re-raises the signal, so the parent sees it.
    assert returncode == -signal.SIGTERM, log
