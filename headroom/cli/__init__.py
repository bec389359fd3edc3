"""The ``headroom`` command line, assembled from one module per command group.

    estimate   estimate.py   per-bucket memory, the peak phase, whether it fits
    gate       gate.py       exit 0 fits, 1 predicted OOM, 2 invalid input, 3 cannot decide
    fit        fit.py        the fastest configuration that fits (--probe: confirmed by runs)
    plan       plan.py       the fastest parallel layout of N GPUs that fits
    launch     launch.py     fit, then train, recorded as a run in the store
    presets    presets.py    the bundled GPU and model presets
    train      train.py      the bundled trainer (what launch and the probes start)
    serve      serve.py      the API and the budget page
    calibrate  calibrate.py  trace, run, fit, report: measure and refit the coefficients

Shared options live in ``options.py``; the exit codes and the one handler that turns a user
mistake into ``error: ...`` and exit 2 in ``exits.py``, and ``main()`` turns a mistake in the
environment (``HEADROOM_*`` settings, the database URL) or the host running out of memory into
one line too. The command modules import only the
planner, typer and rich at import time: ``headroom estimate`` and ``headroom gate`` run without
the service's, the runtime's or the calibration's packages (``pip install headroom-planner``),
and each other command imports what it needs when it runs.
"""

from __future__ import annotations

import sys

import typer

from headroom.cli import (
    calibrate,
    estimate,
    exits,
    fit,
    gate,
    launch,
    plan,
    presets,
    serve,
    train,
)
from headroom.cli.exits import ExitCode

__all__ = ["ExitCode", "app", "main"]

app = typer.Typer(
    name="headroom",
    help="Will this training run fit on the GPU, and where does every byte go?",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# the order of registration is the order of `headroom --help`
app.command("estimate")(estimate.estimate_command)
app.command("gate")(gate.gate_command)
app.command("fit")(fit.fit_command)
app.command("plan")(plan.plan_command)
app.command("launch")(launch.launch_command)
app.command("presets")(presets.presets_command)
app.command("train")(train.train_command)
app.command("serve")(serve.serve_command)
app.add_typer(calibrate.calibrate_app, name="calibrate")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except Exception as exc:  # a missing extra, a bad HEADROOM_* setting, an unusable store...
        known = exits.environment_error(exc)
        if known is None:
            raise  # a bug: its traceback is the report
        message, code = known
        typer.echo(f"error: {message}", err=True)
        sys.exit(code)
