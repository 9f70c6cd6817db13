"""What `pdrouter launch` checks before it says "ready": a bad --model fails at once in one
line, a --port held by another server fails before anything starts, and the router's port is
held from the first step to the router's start."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdrouter.common.proc import find_free_port, wait_for_http
from pdrouter.launch.cluster import Child, Cluster
from pdrouter.launch.spec import BUILTIN_MODELS, ClusterSpec, check_model
from tests.json_reply import reply_json
from tests.pdrouter.launch.launch_cli import start_launch
from tests.repo import REPO_ROOT
from workers.engine.tiny import PRESETS
from workers.models.packaged import PACKAGED_MODELS


def test_the_launcher_knows_the_workers_builtin_models() -> None:
    assert sorted(BUILTIN_MODELS) == sorted([*PRESETS, *PACKAGED_MODELS])


def test_check_model_accepts_names_and_checkpoint_folders(tmp_path: Path) -> None:
    for name in BUILTIN_MODELS:
        check_model(name)
    (tmp_path / "config.json").write_text("{}")
    check_model(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"is a folder without config\.json"):
        check_model(str(tmp_path / "empty"))


@pytest.mark.parametrize("model", ["tiny-typo", "/no/such/folder"])
def test_a_bad_model_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path, model: str
) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pdrouter.cli", "launch", "--model", model,
         "--port", str(find_free_port()), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=120, cwd=str(REPO_ROOT),
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""  # not even "starting ...": no master, no pool
    assert run.stderr == (
        f"pdrouter launch: --model {model!r} is neither a built-in name nor a folder; give one "
        "of demo, tiny, tiny-large or a Hugging Face checkpoint folder (config.json, "
        "tokenizer.json, *.safetensors)\n"
    )
    assert not (tmp_path / "logs").exists()


class _OtherServer(http.server.BaseHTTPRequestHandler):
    """Someone else's server on the port: answers every GET with 200 and a JSON body."""

    def do_GET(self) -> None:
        reply_json(self, json.dumps({"status": "ok", "pid": 1}).encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def taken_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", find_free_port()), _OtherServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_wait_for_http_with_a_pid_does_not_take_another_servers_answer(taken_port: int) -> None:
    url = f"http://127.0.0.1:{taken_port}/health"
    wait_for_http(url, 10, pid=1)  # the other server's own pid: its answer counts
    with pytest.raises(TimeoutError, match=r"answered by another server \(pid 1, not "):
        wait_for_http(url, 0.5, pid=os.getpid())


def test_launch_on_a_taken_port_fails_before_anything_starts(
    tmp_path: Path, tiny_cache_dir: Path, taken_port: int
) -> None:
    proc = start_launch(taken_port, tmp_path, tiny_cache_dir)
    try:
        assert proc.popen.wait(timeout=120) == 1
    finally:
        proc.stop()
    output = proc.log_tail(100_000)
    assert "router ready" not in output and "curl" not in output, output
    assert (
        f"pdrouter launch: start-up failed: port {taken_port} on 127.0.0.1 is in use "
        "(Address already in use)\n" in output
    ), output
    # Nothing was started: no process line, no child's log.
    assert " pid " not in output, output
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["admin_key"]
    # The other server was never touched.
    assert httpx.get(f"http://127.0.0.1:{taken_port}/health", timeout=10).status_code == 200


def test_the_router_port_is_held_until_the_router_is_spawned(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """From the first step to the router's spawn, no process can bind the router's port (the
    CI failure: the router found its --port taken by a process the launcher had started)."""
    port = find_free_port()
    bindable_at_spawn: dict[str, bool] = {}

    def bindable() -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    def spawn(self: Cluster, child: Child) -> None:
        bindable_at_spawn[child.name] = bindable()
        self.children.append(child)

    monkeypatch.setattr(Cluster, "_spawn", spawn)
    monkeypatch.setattr(Cluster, "_wait", lambda self, children: None)
    cluster = Cluster(ClusterSpec(router_port=port, log_dir=str(tmp_path)))
    cluster.start()
    assert bindable_at_spawn == {
        "metadata": False, "mooncake_master": False, "pool-owner": False,
        "prefill-0": False, "decode-0": False, "router": True,
    }  # fmt: skip
    assert cluster.router_url == f"http://127.0.0.1:{port}"

    # A start that fails on the way gives the port back.
    def no_health(self: Cluster, children: list[Child]) -> None:
        raise TimeoutError("no /health")

    monkeypatch.setattr(Cluster, "_wait", no_health)
    with pytest.raises(TimeoutError, match="no /health"):
        Cluster(ClusterSpec(router_port=port, log_dir=str(tmp_path / "2"))).start()
    assert bindable()


def test_tp_sizes_per_role_and_the_short_flag() -> None:
    import argparse

    from pdrouter.common.flags import from_args
    from pdrouter.launch import cli
    from pdrouter.launch.spec import ClusterSpec

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    spec = from_args(ClusterSpec, parser.parse_args(["-tp", "2", "--decode-tp", "1", "2"]))
    assert [spec.tp_size("prefill", i) for i in range(2)] == [2, 2]
    assert [spec.tp_size("decode", i) for i in range(3)] == [1, 2, 1]
    assert spec.tp_size("mixed", 0) == 2
    assert ClusterSpec().tp_size("prefill", 0) == 1
