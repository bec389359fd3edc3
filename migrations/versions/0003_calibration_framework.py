"""calibrations: the training framework a record was measured under

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 09:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # every record stored before the column was measured without a framework
    with op.batch_alter_table("calibrations") as batch:
        batch.add_column(
            sa.Column("framework", sa.String(length=32), nullable=False, server_default="none")
        )


def downgrade() -> None:
    with op.batch_alter_table("calibrations") as batch:
        batch.drop_column("framework")
