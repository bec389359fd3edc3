"""The command line's exit-code table, its public surface and its import-time weight."""

from __future__ import annotations

import subprocess
import sys

import pytest

import headroom.cli
from headroom import planner
from headroom.cli import ExitCode
from headroom.launch.backends import EXIT_OOM as TRAINER_EXIT_OOM


def test_all_is_sorted_and_public() -> None:
    names = headroom.cli.__all__
    assert names == sorted(names)
    assert all(hasattr(headroom.cli, n) for n in names)


def test_the_table_names_each_meaning() -> None:
    assert [(c.name, int(c)) for c in ExitCode] == [
        ("OK", 0),
        ("PREDICTED_OOM", 1),
        ("INVALID_INPUT", 2),
        ("UNDECIDED", 3),
        ("RUN_FAILED", 4),
        ("CANCELLED", 130),
    ]
    # two meanings share 1 and 3: the aliases keep them apart in the code
    assert ExitCode.NOTHING_FITS == ExitCode.PREDICTED_OOM
    assert ExitCode.OUT_OF_MEMORY == ExitCode.UNDECIDED


@pytest.mark.parametrize(
    ("model", "gpu", "require_calibration", "code"),
    [
        ("tiny-dense", "H100-80GB", False, ExitCode.OK),
        ("llama-3-70b", "RTX-4090", False, ExitCode.PREDICTED_OOM),
        ("tiny-dense", "H100-80GB", True, ExitCode.UNDECIDED),
    ],
)
def test_the_gate_verdict_codes_are_the_tables(
    model: str, gpu: str, require_calibration: bool, code: ExitCode
) -> None:
    budget = planner.estimate(planner.load_model(model), planner.TrainSpec(), planner.gpu(gpu))
    assert planner.gate(budget, None, require_calibration).exit_code == code


def test_the_trainer_out_of_memory_code_is_what_the_launcher_reads() -> None:
    assert ExitCode.OUT_OF_MEMORY == TRAINER_EXIT_OOM


def test_importing_the_cli_loads_no_heavy_package() -> None:
    """Typer builds the app at import time: no command module may import these at the top."""
    heavy = ["fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg", "torch", "numpy"]
    heavy += ["matplotlib", "transformers", "pydantic_settings"]
    code = (
        "import sys, headroom.cli, headroom.cli.render; "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert proc.stdout.strip() == "[]"
