"""The budget page: one static HTML page and its script and style sheet, served as files.

The page is plain HTML, CSS and JavaScript with no build step and nothing fetched from outside
the server: it reads ``GET /api/v1/presets`` and posts to ``POST /api/v1/estimate``. None of
these routes is part of the API schema.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

PAGE_DIR = Path(__file__).resolve().parent.parent / "page"

#: the only files served under /static, with their content types
ASSETS: dict[str, str] = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}

# The page loads only its own files and talks only to its own origin.
_CSP = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    """The budget page."""
    return FileResponse(
        PAGE_DIR / "index.html",
        media_type="text/html; charset=utf-8",
        headers={**_HEADERS, "Content-Security-Policy": _CSP},
    )


@router.get("/static/{name}", include_in_schema=False)
def asset(name: str) -> FileResponse:
    """The page's script and style sheet; any other name is a 404."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(status_code=404, detail=f"no static file named {name!r}")
    return FileResponse(PAGE_DIR / name, media_type=media_type, headers=_HEADERS)
