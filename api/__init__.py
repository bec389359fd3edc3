"""Headroom's service: the planner, the store and the launch layer over HTTP, and the page.

``create_app`` (``api.main``) builds the FastAPI app from ``Settings`` (``api.settings``,
``HEADROOM_*``); ``headroom serve`` runs it under uvicorn. Every route lives under ``/api/v1``
(OpenAPI at ``/api/v1/openapi.json``) in one of four routers, each handler named after what it
does:

- ``api.routes.planning``: ``GET /presets`` (``presets``), ``GET /gpus`` (``gpus``),
  ``POST /estimate`` (``estimate``), ``POST /gate`` (``gate``), ``POST /fit`` (``fit``);
- ``api.routes.records``: ``GET|POST /calibrations`` (``list_calibrations``,
  ``add_calibration``), ``GET /calibrations/{id}`` (``get_calibration``), ``GET /coefficients``
  (``coefficients``), ``GET|POST /runs`` (``list_runs``, ``add_run``), ``GET /runs/{id}``
  (``get_run``), ``GET /runs/{id}/logs`` (``run_logs``), ``POST /runs/{id}/cancel``
  (``cancel_run``);
- ``api.routes.page``: the budget page at ``/`` and its assets;
- ``api.routes.docs``: Swagger UI at ``/api/v1/docs``, its files served from the package.

Request and response bodies are ``api.schemas``; errors are RFC 9457 problem+json
(``api.problems``); bearer-token checks are ``api.security``; the Prometheus counters
``api.metrics``. Routes convert bodies to domain types and call the layers below: no arithmetic
lives here.
"""

from headroom.api.main import create_app
from headroom.api.settings import Settings

__all__ = ["Settings", "create_app"]
