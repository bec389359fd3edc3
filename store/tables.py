"""The store's tables (SQLAlchemy 2): calibration records, coefficient sets and runs.

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
    Float,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: the largest row id: the id columns are ``Integer``, 32-bit on PostgreSQL (SQLite would hold
#: 64 bits), so an id above it is refused by the API's path schema on both databases alike
MAX_ROW_ID = 2**31 - 1

#: a run's states; ``headroom.launch.transitions`` moves a run between them
RUN_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def as_utc(value: dt.datetime | None) -> dt.datetime | None:
    """SQLite returns naive datetimes; every stored time is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value


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
    framework: Mapped[str] = mapped_column(String(32), default="none", server_default="none")
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
    request: Mapped[dict[str, Any] | None] = mapped_column(
        JSON,
        nullable=True,
        doc="what the client asked for, canonical (POST /runs): a retry under the run's uid "
        "is compared with it (None: queued otherwise, or before requests were kept)",
    )
    steps: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    job_id: Mapped[str | None] = mapped_column(
        String(64), nullable=True, doc="the Slurm job it was submitted as (backend slurm)"
    )
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    log_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    owner: Mapped[str | None] = mapped_column(
        String(200), nullable=True, doc="host:pid:start-ticks of the supervising process"
    )
    owner_seen_at: Mapped[dt.datetime | None] = mapped_column(
        DateTime(timezone=True),
        nullable=True,
        doc="when its supervisor last said it still watches it (its heartbeat)",
    )
    device: Mapped[str | None] = mapped_column(String(16), nullable=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
