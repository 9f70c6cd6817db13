"""ClusterSecrets: random per cluster unless given, each to the children that use it, under
the child's prefix, and the admin key in a file only its owner can read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pdrouter.launch.secrets import ADMIN_KEY_FILE, ClusterSecrets


def test_keys_are_random_per_cluster_unless_given() -> None:
    a = ClusterSecrets.create(None, None, None)
    b = ClusterSecrets.create(None, None, None)
    assert a.api_key is None and len(a.admin_key) >= 32 and len(a.internal_secret) >= 32
    assert a.admin_key != b.admin_key and a.internal_secret != b.internal_secret
    given = ClusterSecrets.create("k", "a", "s")
    assert (given.api_key, given.admin_key, given.internal_secret) == ("k", "a", "s")
    assert "a" not in repr(given).replace("ClusterSecrets", "")  # no value in a repr


def test_env_carries_only_the_named_secrets_under_the_prefix() -> None:
    s = ClusterSecrets.create("k", "a", "s")
    assert s.env(("api_key", "admin_key", "internal_secret"), "PDROUTER_") == {
        "PDROUTER_API_KEY": "k",
        "PDROUTER_ADMIN_KEY": "a",
        "PDROUTER_INTERNAL_SECRET": "s",
    }
    assert s.env(("admin_key",), "PDWORKER_") == {"PDWORKER_ADMIN_KEY": "a"}
    assert s.env((), "PDWORKER_") == {}
    # An unset API key is left out, not passed empty.
    assert ClusterSecrets.create(None, "a", "s").env(("api_key",), "PDROUTER_") == {}
    assert s.values() == ("k", "a", "s")


def test_admin_key_file_is_0600_and_replaces_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    (tmp_path / ADMIN_KEY_FILE).symlink_to(target)
    old_umask = os.umask(0)  # even a permissive umask gives 0600
    try:
        path = ClusterSecrets.create(None, "the-admin-key", None).write_admin_key(tmp_path)
    finally:
        os.umask(old_umask)
    assert path == tmp_path / ADMIN_KEY_FILE and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "the-admin-key\n"
    assert target.read_text() == "untouched"


def test_a_router_with_a_keys_file_makes_the_launcher_lock_its_workers_to_the_router() -> None:
    from pdrouter.launch.spec import ClusterSpec

    for router_args, env in (
        (("--api-keys-file", "keys.json"), ()),
        (("--max-in-flight", "4", "--api-keys-file=keys.json"), ()),
        ((), (("PDROUTER_API_KEYS_FILE", "keys.json"),)),
    ):
        assert ClusterSpec(router_args=router_args, env=env).keys_file_mode, router_args
    assert ClusterSpec(api_keys_file="keys.json").keys_file_mode  # the launcher's own flag
    assert not ClusterSpec(router_args=("--api-keys-reload-s", "1")).keys_file_mode
    assert not ClusterSpec(api_key="k").keys_file_mode
