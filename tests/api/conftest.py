"""Fixtures of the service tests: a database URL per backend, PostgreSQL in a fresh database.

PostgreSQL is expected at ``HEADROOM_TEST_POSTGRES_URL`` (default: the local server's ``test``
database, used only as the maintenance database to create and drop ``headroom_test_<random>``).
Where it is not reachable, the PostgreSQL tests fail with that in the message: they do not skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

POSTGRES_URL = os.environ.get(
    "HEADROOM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _libpq(url: str) -> str:
    """The SQLAlchemy URL as psycopg takes it."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A SQLAlchemy URL of a new, empty PostgreSQL database, dropped after the test."""
    name = f"headroom_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(_libpq(POSTGRES_URL), autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        unreachable = str(exc).strip()
    else:
        unreachable = ""
    if unreachable:
        pytest.fail(
            f"PostgreSQL is not reachable at {POSTGRES_URL} ({unreachable}); start it or point "
            "HEADROOM_TEST_POSTGRES_URL at a server where the user may create databases",
            pytrace=False,
        )
    with admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(_libpq(POSTGRES_URL), autocommit=True, connect_timeout=5) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An empty database on each backend: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'headroom.db'}"
    return str(request.getfixturevalue("postgres_url"))
