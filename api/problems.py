"""RFC 9457 problem details: every error the service returns has this shape."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

PROBLEM_JSON = "application/problem+json"

_TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    410: "Gone",
    413: "Content too large",
    415: "Unsupported media type",
    416: "Range not satisfiable",
    422: "Invalid input",
    429: "Too many requests",
    503: "Service unavailable",
}


def problem(
    status: int,
    detail: str,
    *,
    title: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """A problem+json response."""
    body = {
        "type": "about:blank",
        "title": title or _TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        **extra,
    }
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


#: seconds a client is asked to wait before retrying what the database could not serve
RETRY_AFTER_S = 5


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """The answer while the database cannot be reached (``store.UNAVAILABLE_ERRORS``): a 503
    to retry, not a 500. A write retried with its ``uid`` is stored once, whether or not the
    first attempt reached the database."""
    return problem(
        503,
        f"the database is unavailable; retry in {RETRY_AFTER_S} s",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


#: OpenAPI description of the problem responses, for routes to declare
PROBLEM_SCHEMA: dict[str, Any] = {
    "content": {
        PROBLEM_JSON: {
            "schema": {
                "type": "object",
                "properties": {
                    "type": {"type": "string"},
                    "title": {"type": "string"},
                    "status": {"type": "integer"},
                    "detail": {"type": "string"},
                },
                "required": ["type", "title", "status", "detail"],
            }
        }
    }
}


#: the 422 problem: the generic members plus one ``{field, message}`` per invalid input
VALIDATION_PROBLEM_SCHEMA: dict[str, Any] = {
    "content": {
        PROBLEM_JSON: {
            "schema": {
                **PROBLEM_SCHEMA["content"][PROBLEM_JSON]["schema"],
                "properties": {
                    **PROBLEM_SCHEMA["content"][PROBLEM_JSON]["schema"]["properties"],
                    "field": {"type": ["string", "null"]},
                    "errors_total": {
                        "type": "integer",
                        "description": "How many invalid inputs there were; at most 20 are listed.",
                    },
                    "errors": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "field": {"type": "string"},
                                "message": {"type": "string"},
                            },
                            "required": ["field", "message"],
                        },
                    },
                },
            }
        }
    }
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each code documented as problem+json."""
    return {
        code: {
            "description": _TITLES.get(code, "Error"),
            **(VALIDATION_PROBLEM_SCHEMA if code == 422 else PROBLEM_SCHEMA),
        }
        for code in codes
    }


def document_validation_problems(openapi: dict[str, Any]) -> dict[str, Any]:
    """Rewrite FastAPI's generated 422 responses (``application/json`` HTTPValidationError) as
    the problem+json the service really returns, and add the 415 every operation with a JSON
    request body returns for a body of another media type; in place, returns ``openapi``."""
    for path in openapi.get("paths", {}).values():
        for operation in path.values():
            codes = operation.get("responses", {}) if isinstance(operation, dict) else {}
            if "422" in codes:
                codes["422"] = {"description": _TITLES[422], **VALIDATION_PROBLEM_SCHEMA}
            if isinstance(operation, dict) and "requestBody" in operation:
                codes.setdefault("415", {"description": _TITLES[415], **PROBLEM_SCHEMA})
    return openapi
