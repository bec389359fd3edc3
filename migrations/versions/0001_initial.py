"""calibrations, coefficient sets and runs

Revision ID: 0001
Revises:
Create Date: 2026-11-21 01:30:05.972021
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("uid", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("model_name", sa.String(length=200), nullable=False),
        sa.Column("gpu_name", sa.String(length=100), nullable=False),
        sa.Column("activation_profile", sa.String(length=64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("measured", sa.JSON(), nullable=False),
        sa.Column("predicted", sa.JSON(), nullable=False),
        sa.Column("measured_peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("predicted_peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("relative_error", sa.Float(), nullable=False),
        sa.Column("notes", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibrations")),
        sa.UniqueConstraint("uid", name=op.f("uq_calibrations_uid")),
    )
    with op.batch_alter_table("calibrations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_calibrations_gpu_name"), ["gpu_name"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_calibrations_model_name"), ["model_name"], unique=False
        )

    op.create_table(
        "coefficient_sets",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("profile", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=100), nullable=True),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("fitted_from", sa.JSON(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_coefficient_sets")),
    )
    with op.batch_alter_table("coefficient_sets", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_coefficient_sets_profile"), ["profile"], unique=False)

    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("uid", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("model_name", sa.String(length=200), nullable=False),
        sa.Column("gpu_name", sa.String(length=100), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("log_path", sa.String(length=1024), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("uid", name=op.f("uq_runs_uid")),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_status"), ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_status"))

    op.drop_table("runs")
    with op.batch_alter_table("coefficient_sets", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_coefficient_sets_profile"))

    op.drop_table("coefficient_sets")
    with op.batch_alter_table("calibrations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_calibrations_model_name"))
        batch_op.drop_index(batch_op.f("ix_calibrations_gpu_name"))

    op.drop_table("calibrations")
