"""schemathesis (a tool nobody here wrote) against the router's and a mixed worker's full
OpenAPI documents, every check on, bounded in time: no server error, no answer that
contradicts the document, the servers still serve afterwards.

One cluster for the module: mooncake master + pool owner + 1 P + 1 D + 1 mixed + router. The
router has an admin key (which schemathesis is not given), so the fuzzer can reach
/instances* only to be refused: registering, draining or deleting the cluster's own instances
would end the test, not find a bug.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, started_cluster

CONFIG = Path(__file__).with_name("schemathesis.toml")
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
# Seconds of generation per document; about 40 s for the two (each covers every operation of
# its document: num_tested == num_operations below).
MAX_TIME_S = 20
WORKER_ARGS = ("--block-size", "16", "--num-kv-blocks", "96", "--max-model-len", "256")
CASES = re.compile(r"^\s*(\d+) generated", re.MULTILINE)
TESTED = re.compile(r"^\s*Tested: (\d+)", re.MULTILINE)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model="tiny",
        num_prefill=1,
        num_decode=1,
        num_mixed=1,
        pool_size="128MiB",
        worker_args=(*WORKER_ARGS, "--model-cache-dir", str(tiny_cache_dir)),
        router_args=("--admin-key", "schemathesis-is-not-given-this"),
        env=QUIET_ENV,
        log_dir=str(tmp_path_factory.mktemp("schemathesis-logs")),
        startup_timeout_s=240.0,
    )
    yield from started_cluster(spec)


def _run_schemathesis(base_url: str, report_dir: Path) -> tuple[int, int, str]:
    """Run schemathesis against base_url's document; (cases generated, operations tested,
    its output)."""
    argv = [
        str(SCHEMATHESIS), "--config-file", str(CONFIG), "run", f"{base_url}/openapi.json",
        "--checks", "all", "--max-time", str(MAX_TIME_S), "--workers", "1",
        "--request-timeout", "60", "--report", "junit", "--report-dir", str(report_dir),
        "--no-color",
    ]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=MAX_TIME_S * 4 + 120, cwd=report_dir
    )
    output = done.stdout + done.stderr
    cases, tested = CASES.search(output), TESTED.search(output)
    assert done.returncode == 0, output
    assert cases is not None and tested is not None, output
    return int(cases.group(1)), int(tested.group(1)), output


def _still_serves(base_url: str) -> None:
    body = {"model": "tiny", "prompt": "still there?", "max_tokens": 3, "ignore_eos": True}
    resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("target", ["router", "worker"])
def test_schemathesis_finds_nothing(
    cluster: Cluster, target: str, tmp_path: Path, record_property: Any
) -> None:
    base_url = cluster.router_url if target == "router" else cluster.mixed_urls[0]
    doc = httpx.get(f"{base_url}/openapi.json", timeout=30).json()
    num_operations = sum(len(operations) for operations in doc["paths"].values())
    num_cases, num_tested, output = _run_schemathesis(base_url, tmp_path)
    print(f"schemathesis against the {target}: {num_cases} cases over {num_tested} "
          "operations, no failure")  # fmt: skip
    record_property("schemathesis_cases", num_cases)  # in the junit report too
    assert num_cases > 0, output
    assert num_tested == num_operations, output
    _still_serves(base_url)
