"""Prompt keys: names of a request's prompt prefixes that the router and P compute alike.

The router does not tokenize (P is the tokenizer of record), so it cannot compute the block
hashes a prompt's KV goes under. Both sides can compute these keys from the OpenAI body:

    chat        key i names messages[0..i] (each message's role and content), one per message
    completion  key i names the prompt string's first (i + 1) * CHUNK_CHARS characters

A key is a chained digest rooted in the request's cache scope (two scopes never share a key,
as they never share a block). P, after tokenizing a prompt, tells which leading full blocks
a few of its keys fix (workers.prefill.prompt_anchors: an anchor is a key, a block count and
the hash of the last of those blocks); the router looks the keys of a new request up among
the anchors it has heard of and asks each P's index whether it holds the anchored block
(pdrouter.router.instances.cache_index). The same body gives the same keys on every replica.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

CHUNK_CHARS = 64
_DIGEST_BYTES = 12


def _step(parent: bytes, part: str) -> bytes:
    return hashlib.blake2b(parent + part.encode(), digest_size=_DIGEST_BYTES).digest()


def _root(cache_scope: str | None) -> bytes:
    return b"prompt-keys:v1:" + (b"" if cache_scope is None else cache_scope.encode())


def template_role(message: dict[str, Any]) -> str:
    role = str(message.get("role", ""))
    return "system" if role == "developer" else role  # as the chat template sees it


def chat_messages(doc: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The body's messages when it is a chat request whose messages are all objects."""
    messages = doc.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    return messages


def prompt_keys(doc: Any, cache_scope: str | None = None) -> list[str]:
    """The hex keys of a body's prompt prefixes (see the module doc); [] for a body that has
    neither chat messages nor a string prompt."""
    if not isinstance(doc, dict):
        return []
    parts: list[str] = []
    messages = chat_messages(doc)
    if messages is not None:
        parts = [f"{template_role(m)}\x00{json.dumps(m.get('content'))}\x01" for m in messages]
    elif isinstance(doc.get("prompt"), str):
        prompt: str = doc["prompt"]
        parts = [
            prompt[start : start + CHUNK_CHARS]
            for start in range(0, len(prompt) - CHUNK_CHARS + 1, CHUNK_CHARS)
        ]
    keys: list[str] = []
    parent = _root(cache_scope)
    for part in parts:
        parent = _step(parent, part)
        keys.append(parent.hex())
    return keys


def body_prompt_keys(body: bytes, cache_scope: str | None = None) -> list[str]:
    """prompt_keys of a JSON body ([] when it is not JSON)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return []
    return prompt_keys(doc, cache_scope)
