"""The store's tables (SQLAlchemy 2) and engine set-up for SQLite and PostgreSQL.

Schema changes go through Alembic (``migrations/``); ``Base.metadata`` is what the migrations
are checked against. Constraint names follow one convention so both databases agree.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Engine,
    Float,
    Integer,
    MetaData,
    String,
    Text,
    create_engine,
    event,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RUN_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Calibration(Base):
    """One measured run compared with the estimate for the same configuration."""

    __tablename__ = "calibrations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    uid: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    source: Mapped[str] = mapped_column(String(32))
    model_name: Mapped[str] = mapped_column(String(200), index=True)
    gpu_name: Mapped[str] = mapped_column(String(100), index=True)
    activation_profile: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    measured: Mapped[dict[str, Any]] = mapped_column(JSON)
    predicted: Mapped[dict[str, Any]] = mapped_column(JSON)
    measured_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    predicted_peak_bytes: Mapped[int] = mapped_column(BigInteger)
    relative_error: Mapped[float] = mapped_column(Float)
    notes: Mapped[str] = mapped_column(Text, default="")


class CoefficientSet(Base):
    """Estimator coefficients fitted from calibration records for one profile and device."""

    __tablename__ = "coefficient_sets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    profile: Mapped[str] = mapped_column(String(64), index=True)
    device: Mapped[str | None] = mapped_column(String(100), nullable=True)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    fitted_from: Mapped[dict[str, Any]] = mapped_column(JSON)
    active: Mapped[bool] = mapped_column(Boolean, default=True)


class Run(Base):
    """A launched (or queued) training run of the bundled trainer."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    uid: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )
    status: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    backend: Mapped[str] = mapped_column(String(32), default="local")
    model_name: Mapped[str] = mapped_column(String(200))
    gpu_name: Mapped[str] = mapped_column(String(100))
    plan: Mapped[dict[str, Any]] = mapped_column(JSON)
    steps: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    log_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    owner: Mapped[str | None] = mapped_column(
        String(200), nullable=True, doc="host:pid:start-ticks of the supervising process"
    )
    device: Mapped[str | None] = mapped_column(String(16), nullable=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


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
    return create_engine(url, pool_pre_ping=True, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker[Any]:
    return sessionmaker(engine, expire_on_commit=False)
