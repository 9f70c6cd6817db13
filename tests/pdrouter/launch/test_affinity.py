"""--cpu-affinity's parsing and the command line of a pinned child (pdrouter.launch.affinity),
without processes; tests/pdrouter/launch/test_launcher_env.py checks real children's masks."""

from __future__ import annotations

import pytest

from pdrouter.launch.affinity import parse_affinity, pinned_argv, role_of


def test_roles_and_cpu_lists_parse_in_order() -> None:
    assert parse_affinity("prefill=0 decode=1,3 router=2-3 pool=1") == (
        ("prefill", "0"), ("decode", "1,3"), ("router", "2-3"), ("pool", "1"),
    )  # fmt: skip
    assert parse_affinity("") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prefill", "ROLE=CPUS"),
        ("gpu=0", "ROLE one of prefill, decode, mixed, router, pool"),
        ("prefill=a", "CPUS is a list"),
        ("prefill=0, decode=1", "CPUS is a list"),
        ("prefill=0 prefill=1", "prefill is pinned twice"),
    ],
)
def test_a_bad_pair_is_refused_with_its_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_affinity(text)


def test_children_are_pinned_by_their_role() -> None:
    names = ["prefill-0", "prefill-12", "decode-1", "mixed-0", "router", "metadata",
             "mooncake_master", "pool-owner"]  # fmt: skip
    assert [role_of(n) for n in names] == ["prefill", "prefill", "decode", "mixed", "router",
                                           "pool", "pool", "pool"]  # fmt: skip
    affinity = parse_affinity("prefill=0 pool=1")
    argv = ["python", "-m", "workers.cli", "serve"]
    assert pinned_argv(argv, "prefill-3", affinity) == ["taskset", "-c", "0", *argv]
    assert pinned_argv(argv, "pool-owner", affinity) == ["taskset", "-c", "1", *argv]
    assert pinned_argv(argv, "decode-0", affinity) is argv  # not named: every CPU
