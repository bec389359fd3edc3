"""A run's probe ladder as a process of its own: ``python -m headroom.launch.probe_process
RUN_DIR --device cpu``.

A run with ``probe`` is confirmed where it will train, by a process that is the run's, not the
service's: the supervisor starts this in the run's process group beside a local run (so a
cancel ends it and its probes, and it dies with the service), and a Slurm job runs it on its
node before the trainer (``slurm.batch_script``). It reads the run's specs from RUN_DIR
(``model.json``, ``train.json``, ``hardware.json``), runs the ladder (``probing.autofit``)
with every file and temporary folder inside RUN_DIR, and writes what happened there:
``probes.json`` (``probing.LadderOutcome``: the ladder's result and the plan each probe ran,
which the supervisor records as calibrations while the run is still running) and, once a
probe confirmed a plan, that plan as ``train.json``, which the trainer reads next. Exit 0: a
plan was confirmed; ``EXIT_NOT_CONFIRMED``: none was. Nothing imports this module: it is only
run (the package reads what it writes through ``probing``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from headroom import planner
from headroom.launch.probing import (
    EXIT_NOT_CONFIRMED,
    HARDWARE_FILE,
    PROBES_FILE,
    SCRATCH,
    LadderOutcome,
    ProbeOutcome,
    autofit,
    subprocess_prober,
)
from headroom.launch.rundirs import write_private


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole (a reader never sees half of it), readable by this user only."""
    partial = path.with_name(f".{path.name}.partial")
    write_private(partial, text)
    partial.replace(path)


def run_ladder(directory: Path, device: str, max_probes: int = 3) -> LadderOutcome:
    """Probe the run in ``directory`` (module doc); what it did, also kept there."""
    model = planner.ModelSpec.model_validate_json((directory / "model.json").read_text())
    train = planner.TrainSpec.model_validate_json((directory / "train.json").read_text())
    hw = planner.Hardware.model_validate_json((directory / HARDWARE_FILE).read_text())
    probed: list[planner.TrainSpec] = []

    def keep(
        plan: planner.TrainSpec, _: planner.Budget | planner.BudgetModel, __: ProbeOutcome
    ) -> None:
        probed.append(plan)  # recorded by the supervisor, while the run is still running

    prober = subprocess_prober(str(directory / "model.json"), hw, device, workdir=directory)
    result = autofit(model, train, hw, prober, max_probes=max_probes, record=keep)
    outcome = LadderOutcome(result=result, probed=probed)
    _replace(directory / PROBES_FILE, outcome.model_dump_json())
    if result.fits and result.confirmed is not None:
        _replace(directory / "train.json", result.confirmed.model_dump_json())
    return outcome


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headroom.launch.probe_process")
    parser.add_argument("run_dir", type=Path, help="The run's directory (its specs).")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--max-probes", type=int, default=3)
    options = parser.parse_args(args)
    directory = options.run_dir.resolve()
    scratch = directory / SCRATCH
    scratch.mkdir(mode=0o700, exist_ok=True)
    # whatever the ladder or a library writes to "the temporary folder" stays in the run's
    os.environ["TMPDIR"] = str(scratch)
    tempfile.tempdir = None
    try:
        outcome = run_ladder(directory, options.device, options.max_probes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"probes: {outcome.result.reason}", flush=True)
    return 0 if outcome.result.fits else EXIT_NOT_CONFIRMED


if __name__ == "__main__":
    sys.exit(main())
