"""Headroom's Alembic environment (``env.py``) and revisions (``versions/``) for the store's
tables (``headroom.store.tables``); ``headroom.store.upgrade`` runs them."""

__all__: list[str] = []
