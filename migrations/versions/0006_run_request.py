"""runs: the request a run was queued from, which a retry under its uid is compared with

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27 07:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a run stored before the column keeps no request: a retry is compared with what its plan
    # kept of it (api.idempotency)
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("request", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("request")
