"""Alembic environment: the URL comes from the caller (``headroom.store.migrate``) or from
HEADROOM_DATABASE_URL; the tables are the store's (``headroom.store.Base``)."""

from __future__ import annotations

from alembic import context

from headroom.store import Base, StoreSettings, make_engine

config = context.config
url = config.get_main_option("sqlalchemy.url") or StoreSettings().database_url


def run_offline() -> None:
    context.configure(
        url=url,
        target_metadata=Base.metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = make_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
