"""`pdrouter launch` as a user runs it: prints the URL, the curl line and every process; stops
everything on Ctrl-C (exit 0), or when an essential process dies (exit 1, naming it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from pdrouter.common.proc import ManagedProcess, find_free_port
from tests.pdrouter.launch.launch_cli import start_launch
from tests.wait import wait_until

pytestmark = pytest.mark.slow


def _launch(tmp_path: Path, cache_dir: Path) -> tuple[ManagedProcess, int]:
    port = find_free_port()
    return start_launch(port, tmp_path, cache_dir), port


def _wait_output(proc: ManagedProcess, pattern: str, timeout_s: float) -> re.Match[str]:
    def printed() -> re.Match[str] | None:
        assert proc.alive(), f"launcher exited {proc.returncode}:\n{proc.log_tail()}"
        return re.search(pattern, proc.log_tail(100_000))

    return wait_until(printed, timeout_s, f"the launcher to print {pattern!r}", interval_s=0.1)


def _pids(output: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r"^(\S+)\s+pid (\d+)", output, re.MULTILINE)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split(")")[-1].split()[0] == "Z"


def _wait_exit(proc: ManagedProcess, timeout_s: float = 60.0) -> int:
    try:
        return proc.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.stop()
        raise


def test_launch_serves_then_ctrl_c_stops_everything(tmp_path: Path, tiny_cache_dir: Path) -> None:
    proc, port = _launch(tmp_path, tiny_cache_dir)
    try:
        _wait_output(proc, rf"router ready: http://127\.0\.0\.1:{port}/v1", 240)
        output = proc.log_tail(100_000)
        assert f"curl -N http://127.0.0.1:{port}/v1/chat/completions" in output
        pids = _pids(output)
        names = {"metadata", "mooncake_master", "pool-owner", "prefill-0", "decode-0", "router"}
        assert set(pids) == names
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        proc.popen.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the launcher
        assert _wait_exit(proc) == 0
        assert proc.log_tail().rstrip().endswith("stopped")
        assert [name for name, pid in pids.items() if not _gone(pid)] == []
    finally:
        proc.stop()


def test_launch_stops_everything_when_the_router_dies(tmp_path: Path, tiny_cache_dir: Path) -> None:
    proc, _port = _launch(tmp_path, tiny_cache_dir)
    try:
        _wait_output(proc, r"router ready", 240)
        pids = _pids(proc.log_tail(100_000))
        os.killpg(pids["router"], signal.SIGKILL)  # the router runs in its own process group
        assert _wait_exit(proc) == 1
        assert re.search(r"router \(exit code -9\) died: stopping the cluster", proc.log_tail())
        assert [name for name, pid in pids.items() if not _gone(pid)] == []
    finally:
        proc.stop()


def test_a_keys_file_set_in_the_launchers_environment_locks_the_cluster(
    tmp_path: Path, tiny_cache_dir: Path
) -> None:
    """PDROUTER_API_KEYS_FILE is the launcher's own --api-keys-file: the router gets the file
    and the workers answer the router alone. It used to be stripped with the launcher's other
    variables, and the cluster came up open to anyone."""
    keys = tmp_path / "keys.json"
    keys.write_text('{"keys": [{"id": "team", "key": "sk-team"}]}')
    port = find_free_port()
    proc = start_launch(port, tmp_path, tiny_cache_dir, env={"PDROUTER_API_KEYS_FILE": str(keys)})
    try:
        output = _wait_output(proc, rf"router ready: http://127\.0\.0\.1:{port}/v1", 240).string
        router = f"http://127.0.0.1:{port}"
        team = {"Authorization": "Bearer sk-team"}
        assert httpx.get(f"{router}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{router}/v1/models", headers=team, timeout=10).status_code == 200
        worker_port = re.search(r"prefill-0\s+pid \d+\s+http://127\.0\.0\.1:(\d+)", output)
        assert worker_port is not None, output
        worker = f"http://127.0.0.1:{worker_port[1]}"
        for headers in ({}, team):  # a key of the file never opens a worker
            assert httpx.get(f"{worker}/v1/models", headers=headers, timeout=10).status_code == 401
    finally:
        proc.stop()
