"""The Allow header of a 405: every method some route serves on the requested path.

Starlette answers a 405 from the first route whose path matches, naming only that route's
methods; a path served by several routes (GET and POST /instances) needs the union, and the
OpenAI error handlers of the router and the workers build their own 405 body anyway. Both call
`allowed_methods` (RFC 9110: a 405 MUST carry Allow). The doors (pdrouter.common.auth) come
first: without the key a wrong method gets 401, so that a 405 never tells who holds no key
which routes exist.
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
