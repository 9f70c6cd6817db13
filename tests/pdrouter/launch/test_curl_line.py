"""The curl line `pdrouter launch` prints names the variable the key is given in, never the key."""

from __future__ import annotations

import shlex

from pdrouter.launch.cli import curl_line


def test_keyed_curl_uses_the_launchers_key_variable() -> None:
    line = curl_line("http://127.0.0.1:8000", "tiny", keyed=True)
    assert '-H "Authorization: Bearer $PDROUTER_API_KEY"' in line
    assert "$API_KEY" not in line.replace("$PDROUTER_API_KEY", "")
    assert shlex.split(line)[:3] == ["curl", "-N", "http://127.0.0.1:8000/v1/chat/completions"]


def test_open_curl_has_no_authorization() -> None:
    assert "Authorization" not in curl_line("http://h:1", "demo", keyed=False)
