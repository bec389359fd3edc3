"""``headroom serve``: the API and the budget page (the extra ``headroom-planner[service]``).

uvicorn and the API are imported inside the command, so the gate and the estimator run without
the service's packages installed.
"""

from __future__ import annotations

from typing import Annotated

import typer


def serve_command(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port.")] = 8000,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Worker processes.")] = 1,
) -> None:
    """Serve the API and the budget page, after upgrading the database to the latest migration."""
    import os

    import uvicorn

    from headroom.api.main import log_config
    from headroom.api.settings import Settings
    from headroom.store import upgrade

    settings = Settings()
    if settings.migrate:
        upgrade(settings.database_url)  # once, before any worker starts
    os.environ["HEADROOM_MIGRATE"] = "false"
    uvicorn.run(
        "headroom.api.main:app",
        host=host,
        port=port,
        workers=workers,
        http="headroom.api.protocol:HeadLimitedProtocol",  # httptools with a bounded head
        log_level="info",
        log_config=log_config(),  # the project's INFO lines too
        access_log=False,
    )
