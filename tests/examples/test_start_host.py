"""examples/start_host.sh refuses a role whose settings are missing, naming each variable,
before starting anything (its working runs are tests/e2e/multihost, which starts every host's
processes through it)."""

from __future__ import annotations

import subprocess

import pytest

from tests.repo import REPO_ROOT

SCRIPT = str(REPO_ROOT / "examples" / "start_host.sh")


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", SCRIPT, *args], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=30)  # fmt: skip


@pytest.mark.parametrize(
    ("role", "env", "missing"),
    [
        ("master", {}, "HOST_ADDR"),
        ("pool", {"HOST_ADDR": "10.0.0.2"}, "MASTER_ADDR"),
        ("prefill", {"HOST_ADDR": "10.0.0.2"}, "MASTER_ADDR ROUTERS ADMIN_KEY INTERNAL_SECRET"),
        (
            "decode",
            {"HOST_ADDR": "10.0.0.3", "MASTER_ADDR": "10.0.0.1", "ADMIN_KEY": "k"},
            "ROUTERS INTERNAL_SECRET",
        ),
        ("router", {"HOST_ADDR": "10.0.0.4"}, "ADMIN_KEY INTERNAL_SECRET"),
    ],
)
def test_missing_settings_are_named(role: str, env: dict[str, str], missing: str) -> None:
    result = _run([role], env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"start_host.sh {role}: set {missing} (see the top of this script)\n")


def test_an_unknown_role_is_refused() -> None:
    result = _run(["gateway"], {"HOST_ADDR": "10.0.0.4"})
    assert (result.returncode, result.stderr) == (
        2, "unknown role gateway (master|metadata|pool|prefill|decode|router)\n")  # fmt: skip
