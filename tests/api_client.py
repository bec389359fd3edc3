"""The tests' one way to talk to the service in process: an app on a given database, with a
token, no supervisor, and server errors answered (not raised) so a test can assert on a 500."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient

from headroom.api import Settings, create_app


@contextmanager
def service_client(database_url: str, token: str) -> Iterator[TestClient]:
    """A ``TestClient`` on a new app over ``database_url``; its engine is disposed afterwards."""
    app = create_app(Settings(database_url=database_url, token=token, launch_runs=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    app.state.engine.dispose()
