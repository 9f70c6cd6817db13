"""The Allow header of a 405: every method some route serves on the requested path.

Starlette answers a 405 from the first route whose path matches, naming only that route's
methods; a path served by several routes (GET and POST /instances) needs the union, and the
OpenAI error handlers of the router and the workers build their own 405 body anyway. Both call
`allowed_methods` (RFC 9110: a 405 MUST carry Allow). The doors (pdrouter.common.auth) let a
method no route serves on a known path through to that 405 (`method_not_served`).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

from starlette.routing import Match


def allowed_methods(routes: Iterable[Any], scope: MutableMapping[str, Any]) -> str:
    """'GET, POST' for the methods of every route whose path matches scope's path."""
    methods: set[str] = set()
    for route in routes:
        route_methods = getattr(route, "methods", None)
        if not route_methods:
            continue
        match, _ = route.matches({**scope, "method": next(iter(route_methods))})
        if match == Match.FULL:
            methods |= set(route_methods)
    return ", ".join(sorted(methods))


def method_not_served(routes: Iterable[Any], scope: MutableMapping[str, Any]) -> bool:
    """True when some route serves scope's path, but none with its method. Such a request is
    answered 405 with Allow before any key check (schemathesis and RFC 9110 want the 405):
    it names only methods of a path the API documents, never data behind a key; an unknown
    path still gets the gate's 401."""
    allowed = allowed_methods(routes, scope)
    return bool(allowed) and scope["method"] not in allowed.split(", ")
