"""runs: the supervising process (owner) and the device a run trains on

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 04:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("device", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("device")
        batch.drop_column("owner")
