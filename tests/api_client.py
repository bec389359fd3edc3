"""The tests' one way to talk to the service in process: an app on a given database, with a
token, no supervisor, and server errors answered (not raised) so a test can assert on a 500;
and ``wait_for``, for what the service (or its supervisor) does in its own time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient

from headroom.api import Settings, create_app


@contextmanager
def service_client(database_url: str, token: str) -> Iterator[TestClient]:
    """A ``TestClient`` on a new app over ``database_url``; its engine is disposed afterwards."""
    app = create_app(Settings(database_url=database_url, token=token, launch_runs=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    app.state.engine.dispose()


def wait_for(check: Callable[[], Any], timeout: float = 120, what: str = "") -> Any:
    """``check()``'s first truthy value, polled every 0.1 s; an AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
