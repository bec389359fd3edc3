"""runs: the Slurm job a run was submitted as

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 14:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # runs stored before the column ran as processes, never as jobs
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("job_id", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("job_id")
