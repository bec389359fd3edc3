"""The Headroom service: the planner, the store and the page over HTTP under ``/api/v1``.

Errors are RFC 9457 problem+json, never a traceback; a predicted OOM is a 200 with
``fits: false``. No arithmetic lives here: routes call the planner, calibration, the store and
the launch layer.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from headroom import planner, store
from headroom.api.idempotency import UidConflict
from headroom.api.latency import settle_for_serving
from headroom.api.metrics import Metrics
from headroom.api.problems import (
    RETRY_AFTER_S,
    database_unavailable,
    document_validation_problems,
    problem,
    responses,
)
from headroom.api.routes import docs, page, planning, records
from headroom.api.routing import HeadAsGet, allowed_methods
from headroom.api.security import AuthError, require_token
from headroom.api.settings import Settings
from headroom.launch import Supervisor

PREFIX = "/api/v1"
log = logging.getLogger("headroom.api")


def log_config() -> dict[str, Any]:
    """``headroom serve``'s logging: uvicorn's own configuration, and the project's loggers
    (``headroom.*``) at INFO on stderr, each line naming its logger.

    uvicorn configures only its own loggers, so the run supervisor's INFO lines (the database
    reachable again, run directories removed) were dropped, and its warnings reached stderr
    unformatted through logging's last-resort handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["headroom"] = {
        "()": "uvicorn.logging.DefaultFormatter",
        "fmt": "%(levelprefix)s %(name)s: %(message)s",
        "use_colors": None,
    }
    config["handlers"]["headroom"] = {
        "formatter": "headroom",
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
    }
    config["loggers"]["headroom"] = {"handlers": ["headroom"], "level": "INFO", "propagate": False}
    return config


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with a 413 problem: a declared length at
    once, a streamed body once the app has read past the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = self.limit + 1
        if declared is not None:
            if declared > self.limit:
                await self._refuse(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        # no declared length (chunked): counted as the app reads it. Past the limit the read
        # raises the 413 (as Starlette's RequestBodyLimitMiddleware does), so a body nobody
        # reads (a write refused for its token) is never read here either
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, self._detail)
            return message

        await self.app(scope, counted, send)

    @property
    def _detail(self) -> str:
        return f"request body is larger than {self.limit} bytes"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await problem(413, self._detail)(scope, receive, send)


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "body"


#: most ``{field, message}`` entries one 422 lists (the rest are counted in ``errors_total``)
MAX_LISTED_ERRORS = 20
#: longest field name a 422 repeats (a client's own key, echoed back, is capped)
MAX_FIELD_CHARS = 200


def _capped(text: str) -> str:
    return text if len(text) <= MAX_FIELD_CHARS else text[: MAX_FIELD_CHARS - 1] + "…"


def _error(error: Any, body: Any) -> dict[str, str]:
    """``{field, message}`` for one of FastAPI's validation errors.

    A body the JSON parser gave up on comes as ``loc ('body', <character offset>)``: the offset
    is no field, so it names the body and says where (line, column, character) it broke."""
    if error.get("type") == "json_invalid":
        offset = error["loc"][-1] if len(error["loc"]) > 1 else None
        reason = (error.get("ctx") or {}).get("error") or error["msg"]
        where = " (the body)"
        if isinstance(offset, int) and isinstance(body, str):
            line = body.count("\n", 0, offset) + 1
            column = offset - body.rfind("\n", 0, offset)
            where = f" line {line}, column {column} (character {offset})"
        # json's own wording ("Expecting ',' delimiter", "Unterminated string starting at")
        return {"field": "body", "message": f"not valid JSON: {reason}{where}"}
    return {"field": _capped(_field(error["loc"])), "message": _capped(error["msg"])}


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this media type as JSON (application/json or +json)."""
    media = (content_type or "").partition(";")[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the application for ``settings`` (default: from the environment)."""
    settings = settings or Settings()
    engine = store.make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.migrate:
            store.upgrade(settings.database_url)
        supervisor = None
        if settings.launch_runs:
            supervisor = app.state.supervisor = Supervisor(app.state.sessionmaker, settings)
            supervisor.start()
        yield
        if supervisor is not None:
            supervisor.close()
        engine.dispose()

    app = FastAPI(
        title="Headroom",
        version="0.1.0",
        summary="Memory-budget planner and OOM predictor for training large transformers.",
        openapi_url=f"{PREFIX}/openapi.json",
        docs_url=None,  # served by api.routes.docs, from the package
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = store.make_sessionmaker(engine)
    app.state.metrics = metrics = Metrics()

    @app.exception_handler(planner.HeadroomError)
    async def _spec_error(request: Request, exc: planner.HeadroomError) -> JSONResponse:
        return problem(422, str(exc), field=exc.field)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type")
        if not _is_json(content_type) and any(e["loc"][:1] == ("body",) for e in exc.errors()):
            # FastAPI hands a route a body of any other media type as bytes, which then fails
            # validation as "not an object": the media type is what is wrong
            got = f"got {content_type!r}" if content_type else "got no Content-Type"
            return problem(
                415,
                f"Content-Type: send the body as application/json; {got}",
                headers={"Accept-Post": "application/json"},
            )
        # a body with thousands of mistakes gets the first few and a count: its answer (and the
        # CPU to encode it) must not grow with what the client sent
        found = exc.errors()
        errors = [_error(e, exc.body) for e in found[:MAX_LISTED_ERRORS]]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:10])
        if len(found) > len(errors):
            detail += f"; and {len(found) - len(errors)} more"
        return problem(422, detail, errors=errors, errors_total=len(found))

    for unavailable in store.UNAVAILABLE_ERRORS:  # the database is away: 503, Retry-After
        app.add_exception_handler(unavailable, database_unavailable)

    @app.exception_handler(AuthError)
    async def _auth(request: Request, exc: AuthError) -> JSONResponse:
        return problem(401, exc.detail, headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # the client went before its body was in (or its body's deadline passed: the protocol
        # has answered 408): no one reads this, and it is no error of the service's
        return problem(400, "the connection closed before the request body was in")

    @app.exception_handler(records.NotFound)
    async def _not_found(request: Request, exc: records.NotFound) -> JSONResponse:
        return problem(404, str(exc))

    @app.exception_handler(UidConflict)
    async def _uid_conflict(request: Request, exc: UidConflict) -> JSONResponse:
        return problem(409, str(exc), field="uid", uid=exc.uid, differs=exc.differs)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:  # Starlette names the methods of one route of the path
            allow = allowed_methods(app.routes, request.scope)
            detail = f"{request.method} is not served at {request.url.path}; allowed: {allow}"
            return problem(405, detail, headers={**(headers or {}), "Allow": allow})
        if exc.status_code == 400:
            # FastAPI's only 400: a body it could not decode (not UTF-8, nested too deep for
            # the JSON parser); that is invalid input like any other
            detail = f"body: {exc.detail}; send a JSON object (UTF-8)"
            errors = [{"field": "body", "message": str(exc.detail)}]
            return problem(422, detail, field="body", errors=errors, headers=headers)
        return problem(exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem(500, "internal error; the server log has the details", title="Error")

    @app.get("/healthz", tags=["health"], include_in_schema=False)
    @app.get(f"{PREFIX}/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process is alive (answered on the event loop: no thread to wait for)."""
        return {"status": "ok"}

    head = store.head_revision()  # this code's: read once (2 ms of CPU per read)

    @app.get("/readyz", tags=["health"], include_in_schema=False)
    @app.get(f"{PREFIX}/readyz", tags=["health"], responses=responses(503))
    def readyz() -> JSONResponse:
        """The database is reachable and migrated to the latest revision."""
        try:
            with engine.connect() as connection:
                current = store.revision_of(connection)  # reads alembic_version: reachable
        except Exception as exc:  # any driver error means not ready
            return problem(
                503,
                f"database unreachable: {type(exc).__name__}",
                title="Not ready",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if current != head:
            return problem(
                503,
                f"database at revision {current}, expected {head}",
                title="Not ready",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return JSONResponse({"status": "ready", "revision": current})

    app.include_router(page.router)
    app.include_router(docs.router, prefix=PREFIX)
    app.include_router(planning.router, prefix=PREFIX)
    # writes always need the token (records.py); reads of the records on request
    reads = [Depends(require_token)] if settings.require_token_for_reads else []
    app.include_router(records.router, prefix=PREFIX, dependencies=reads)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_validation_problems(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    Instrumentator(registry=metrics.registry, excluded_handlers=["/metrics"]).instrument(
        app
    ).expose(app, endpoint="/metrics", include_in_schema=False)
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    # ``uvicorn api.main:app`` builds the app from the environment on first use, not on import
    global _app
    if name == "app":
        if _app is None:
            _app = create_app()
            settle_for_serving()  # the process serves it: api/latency.py
        return _app
    raise AttributeError(name)
