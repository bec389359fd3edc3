"""The API's documentation page, Swagger UI, served by this server with nothing from outside.

FastAPI's own docs page loads the latest Swagger UI from a CDN with no integrity hash: what the
page runs could change under it. Here the script and style sheet come from the pinned
``fastapi-offline`` package (which ships Swagger UI 5, Apache-2.0, in ``fastapi_offline/static``)
and are served under ``/api/v1/docs/assets/``; the page is FastAPI's ``get_swagger_ui_html``
pointed at them (FastAPI's recipe for self-hosted docs assets), with a policy that lets it load
only from this origin.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

#: where the pinned package keeps Swagger UI's files
ASSET_DIR = Path(str(resources.files("fastapi_offline") / "static"))
#: the only files served under /docs/assets, with their content types
ASSETS: dict[str, str] = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}

# Swagger UI starts from an inline script and draws with inline styles and data: images; it
# talks only to this origin (the schema, and "Try it out").
_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)

router = APIRouter(include_in_schema=False)


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI for this API's OpenAPI document."""

    def asset(name: str) -> str:
        return request.url_for("docs_asset", name=name).path

    root_path = request.scope.get("root_path", "").rstrip("/")
    response = get_swagger_ui_html(
        openapi_url=f"{root_path}{request.app.openapi_url}",
        title=f"{request.app.title} API",
        swagger_js_url=asset("swagger-ui-bundle.js"),
        swagger_css_url=asset("swagger-ui.css"),
        swagger_favicon_url=asset("favicon.png"),
    )
    response.headers["Content-Security-Policy"] = _CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


@router.get("/docs/assets/{name}")
def docs_asset(name: str) -> FileResponse:
    """Swagger UI's script, style sheet and icon; any other name is a 404."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(status_code=404, detail=f"no docs asset named {name!r}")
    return FileResponse(
        ASSET_DIR / name,
        media_type=media_type,
        headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"},
    )
