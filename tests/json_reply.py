"""Answering with a JSON body from a test's http.server handler (a stand-in server)."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler


def reply_json(handler: BaseHTTPRequestHandler, body: bytes, status: int = 200) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
