"""Request-scoped dependencies: a database session and the app's settings and metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from headroom import store
from headroom.api.metrics import Metrics
from headroom.api.settings import Settings


def session(request: Request) -> Iterator[Session]:
    s = request.app.state.sessionmaker()
    try:
        yield s
    finally:
        # a connection the database dropped fails even to roll back: there is nothing left to
        # release, and the answer (often sent already) stands
        with contextlib.suppress(*store.UNAVAILABLE_ERRORS):
            s.close()


def settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def metrics(request: Request) -> Metrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


SessionDep = Annotated[Session, Depends(session)]
SettingsDep = Annotated[Settings, Depends(settings)]
MetricsDep = Annotated[Metrics, Depends(metrics)]
