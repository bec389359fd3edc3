"""runs: when the run's supervisor last said it still watches it

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 14:20:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a run stored before the column has no heartbeat: its owner is judged as before
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner_seen_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("owner_seen_at")
