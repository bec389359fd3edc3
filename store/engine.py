"""Engines and sessions on the configured database (SQLite or PostgreSQL).

``StoreSettings`` reads ``HEADROOM_DATABASE_URL``: the service's settings extend it, and the
command line opens the same store through ``headroom.store.open_store``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import Engine, create_engine, event, exc, make_url
from sqlalchemy.orm import Session, sessionmaker

#: what SQLAlchemy raises when the database cannot serve a request now (unreachable, the
#: connection broke, SQLite locked, the pool exhausted): the service answers 503 and the run
#: supervisor waits for the database to return, rather than treating it as a bug
UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    exc.OperationalError,
    exc.InterfaceError,
    exc.DisconnectionError,
    exc.TimeoutError,
)
#: seconds a PostgreSQL connection attempt may take before the database counts as unreachable
CONNECT_TIMEOUT_S = 5


def unavailable(error: BaseException) -> bool:
    """Whether ``error`` says the database is unavailable now (``UNAVAILABLE_ERRORS``, or a
    driver error that broke the connection), not that a statement is wrong."""
    if isinstance(error, UNAVAILABLE_ERRORS):
        return True
    return isinstance(error, exc.DBAPIError) and error.connection_invalidated


class StoreSettings(BaseSettings):
    """Where the store is (``HEADROOM_DATABASE_URL``)."""

    model_config = SettingsConfigDict(env_prefix="HEADROOM_", extra="ignore")

    database_url: str = Field(
        default="sqlite:///headroom.db",
        description="SQLAlchemy URL: SQLite (the embedded default) or postgresql+psycopg://…",
    )


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``; SQLite gets WAL, full sync and a busy timeout for writers."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    if url.startswith("postgresql") and "connect_timeout" not in make_url(url).query:
        # a database that went away fails a request in seconds, not after TCP's retries
        kwargs.setdefault("connect_args", {"connect_timeout": CONNECT_TIMEOUT_S})
    return create_engine(url, pool_pre_ping=True, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
