"""How requests meet the routes, where FastAPI's defaults fall short of HTTP.

- ``HEAD`` is answered for every ``GET`` route: the ``GET`` response's status and headers,
  without its body (FastAPI routes answer only the methods they declare: ``HEAD`` was a 405).
- A 405 lists every method of the path in ``Allow``, not only those of the first route that
  matched it (``/runs`` said ``POST`` where ``GET`` is served too).
- A query parameter given twice is a 422 naming it: FastAPI keeps the last value of a scalar
  parameter and drops the others silently.
- A row's id in a path (``{calibration_id:rowid}``) is any segment but a sibling route's name:
  ``GET /calibrations/ingest`` is a 405 (that path is ``POST``'s), not a 422 about an id.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.convertors import Convertor, register_url_convertor
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: the fixed segments that sit where a row id does (``/calibrations/ingest``)
SIBLING_SEGMENTS = ("ingest",)


class RowIdConvertor(Convertor[str]):
    """A path segment that can be a row id: any but a sibling route's name. The route's own
    validation (``api.routes.records.RowId``) then refuses what is not an id, with a 422."""

    regex = "".join(f"(?!{name}$)" for name in SIBLING_SEGMENTS) + "[^/]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return str(value)


register_url_convertor("rowid", RowIdConvertor())


class HeadAsGet:
    """Answer ``HEAD`` as the app answers ``GET``, without the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


#: the methods a 405 may list (HEAD is added for GET, see HeadAsGet)
_METHODS = ("DELETE", "GET", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The ``Allow`` value for the request's path: each method some route serves it with.

    Asked of the routes themselves (routers nest them), one method at a time."""
    methods = {
        method
        for method in _METHODS
        if any(route.matches({**scope, "method": method})[0] is Match.FULL for route in routes)
    }
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


async def single_valued_query(request: Request) -> None:
    """Refuse a query parameter given more than once (each of this API's takes one value)."""
    seen: dict[str, list[str]] = {}
    for name, value in request.query_params.multi_items():
        seen.setdefault(name, []).append(value)
    repeated = [
        {
            "type": "repeated_parameter",
            "loc": ("query", name),
            "msg": f"given {len(values)} times; give it once",
            "input": values[:10],
        }
        for name, values in seen.items()
        if len(values) > 1
    ]
    if repeated:
        raise RequestValidationError(repeated)
