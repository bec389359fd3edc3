"""The Headroom service: the planner over HTTP under ``/api/v1``.

This is the service's first slice: health, presets and estimates. Errors are RFC 9457
problem+json; a predicted OOM is a 200 with ``fits: false``. No arithmetic lives here.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import planner

PREFIX = "/api/v1"


def _problem(status: int, title: str, detail: str, **extra: Any) -> JSONResponse:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    return JSONResponse(body, status_code=status, media_type="application/problem+json")


def create_app() -> FastAPI:
    """Build the FastAPI application."""
    app = FastAPI(
        title="Headroom",
        version="0.1.0",
        openapi_url=f"{PREFIX}/openapi.json",
        docs_url=f"{PREFIX}/docs",
        redoc_url=None,
    )

    @app.exception_handler(planner.HeadroomError)
    async def _spec_error(request: Request, exc: planner.HeadroomError) -> JSONResponse:
        return _problem(422, "Invalid input", str(exc), field=exc.field)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()
        ]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return _problem(422, "Invalid input", detail, errors=errors)

    @app.get("/healthz")
    @app.get(f"{PREFIX}/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(f"{PREFIX}/presets")
    def presets() -> dict[str, Any]:
        return {
            "gpus": [planner.gpu(n).model_dump() for n in planner.gpu_names()],
            "models": [
                {"name": n, "params_total": planner.count_params(planner.load_model(n)).total}
                for n in planner.model_names()
            ],
        }

    @app.post(f"{PREFIX}/estimate")
    def estimate(
        model: Annotated[str | dict[str, Any], Body(description="Preset, our spec or config.json")],
        train: Annotated[dict[str, Any] | None, Body()] = None,
        gpu: Annotated[str | dict[str, Any], Body()] = "H100-80GB",
        host_memory: Annotated[str | int | None, Body()] = None,
    ) -> dict[str, Any]:
        spec = planner.load_model(model)
        train_spec = planner.load_train(train or {})
        hw = planner.load_hardware(gpu, host_memory=host_memory)
        return planner.estimate(spec, train_spec, hw).model_dump()

    return app


app = create_app()
