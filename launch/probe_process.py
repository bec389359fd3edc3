"""A run's probe ladder as a process of its own: ``python -m headroom.launch.probe_process
RUN_DIR --device cpu``.

A run with ``probe`` is confirmed where it will train, by a process that is the run's, not the
service's: the supervisor starts this in the run's process group beside a local run (so a
cancel ends it and its probes, and it dies with the service), and a Slurm job runs it on its
node before the trainer (``slurm.batch_script``). It reads the run's specs from RUN_DIR
(``model.json``, ``train.json``, ``hardware.json``), runs the ladder (``probing.autofit``)
with every file and temporary folder inside RUN_DIR, and writes what happened there:
``probes.json`` (``LadderOutcome``: the ladder's result and the plan each probe ran, which the
supervisor records as calibrations once the run is still its to record) and, once a probe
confirmed a plan, that plan as ``train.json``, which the trainer reads next. Exit 0: a plan
was confirmed; ``EXIT_NOT_CONFIRMED``: none was.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field

from headroom import planner
from headroom.launch.probing import AutoFitResult, ProbeOutcome, autofit, subprocess_prober
from headroom.launch.rundirs import write_private

#: what the ladder writes into the run's directory
PROBES_FILE = "probes.json"
#: the run's card, which the ladder fits and caps its probes to
HARDWARE_FILE = "hardware.json"
#: exit code when no probe confirmed a plan
EXIT_NOT_CONFIRMED = 1
#: the folder under the run's directory its probes' temporary files go to
SCRATCH = "tmp"


class LadderOutcome(BaseModel):
    """What the ladder of one run did: its result, and the plan each of its probes ran (the
    n-th probe of ``result.probes`` ran ``probed[n]``)."""

    result: AutoFitResult
    probed: list[planner.TrainSpec] = Field(default_factory=list)


def argv(directory: Path, device: str, python: str = sys.executable) -> list[str]:
    """The command that runs the ladder of the run in ``directory`` on ``device``."""
    return [python, "-m", "headroom.launch.probe_process", str(directory), "--device", device]


def read_outcome(directory: Path) -> LadderOutcome | None:
    """What the ladder wrote into ``directory`` (None: nothing, or not readable as that)."""
    try:
        return LadderOutcome.model_validate_json((directory / PROBES_FILE).read_text())
    except (OSError, ValueError):
        return None


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
