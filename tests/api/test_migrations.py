"""Migrations go up to head, down to base and up again on SQLite and PostgreSQL, and the
migrated schema is exactly ``Base.metadata`` (Alembic's autogenerate finds nothing to do)."""

from __future__ import annotations

from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select

from headroom.store import Base, Calibration, make_engine, make_sessionmaker, migrate

TABLES = set(Base.metadata.tables)


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _schema_diff(url: str) -> list[Any]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def _assert_at_head(url: str) -> None:
    assert _tables(url) >= TABLES
    assert migrate.current_revision(url) == migrate.head_revision()
    assert _schema_diff(url) == []


def _assert_at_base(url: str) -> None:
    # alembic keeps its (now empty) version table; every table of ours is gone
    assert _tables(url) & TABLES == set()
    assert migrate.current_revision(url) is None


def _round_trip_a_row(url: str) -> None:
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            session.add(
                Calibration(
                    uid="m-1",
                    source="external",
                    model_name="tiny-dense",
                    gpu_name="H100-80GB",
                    activation_profile="textbook",
                    spec={"model": {"name": "tiny-dense"}},
                    measured={"allocated_bytes": 2**40},
                    predicted={"peak": 2**62},
                    measured_peak_bytes=2**40,
                    predicted_peak_bytes=2**63 - 1,
                    relative_error=0.25,
                )
            )
            session.commit()
            row = session.scalars(select(Calibration)).one()
            assert row.predicted_peak_bytes == 2**63 - 1
            assert row.predicted == {"peak": 2**62}
            assert row.notes == ""
    finally:
        engine.dispose()


def test_migrations_up_down_up_match_the_models(database_url: str) -> None:
    assert {"calibrations", "coefficient_sets", "runs"} == TABLES
    assert _tables(database_url) == set()

    migrate.upgrade(database_url)
    _assert_at_head(database_url)
    _round_trip_a_row(database_url)

    migrate.downgrade(database_url, "base")
    _assert_at_base(database_url)

    migrate.upgrade(database_url)
    _assert_at_head(database_url)
    _round_trip_a_row(database_url)  # the downgrade dropped the first row with its table

    migrate.upgrade(database_url)  # already at head: nothing to do, nothing breaks
    _assert_at_head(database_url)
