"""Request bodies for the wire parsing tests: a minimal valid chat or completion request with
fields on top, and the ProtocolError a refused body raises."""

from __future__ import annotations

import json

import pytest

from pdrouter.wire.openai import ProtocolError, parse_request


def chat_body(**fields: object) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def completion_body(**fields: object) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", **fields}).encode()


def refused(request_cls: type, body: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_request(request_cls, body)
    return info.value
