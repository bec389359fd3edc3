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
import typing
from importlib import metadata

import typer
from typer._click import exceptions as click_errors  # what typer's own click raises

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


def _version(value: bool) -> None:
    if value:
        try:
            version = metadata.version(_DISTRIBUTION)
        except metadata.PackageNotFoundError:  # run from a checkout that was never installed
            version = "unknown (not installed)"
        typer.echo(f"headroom {version} ({_DISTRIBUTION})")
        raise typer.Exit(0)


#: the name the package index knows Headroom by (its ``headroom`` is another project)
_DISTRIBUTION = "headroom-planner"


@app.callback()
def _root(
    version: typing.Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Print the installed version and exit.",
        ),
    ] = False,
) -> None:
    """Will this training run fit on the GPU, and where does every byte go?"""


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


def _usage_error(exc: click_errors.UsageError) -> None:
    """A mistake on the command line (an unknown option, a value out of range) as every other
    user mistake is: one line, ``error: ...``, exit 2; a bare group prints its help."""
    if isinstance(exc, click_errors.NoArgsIsHelpError) and exc.ctx is not None:
        typer.echo(exc.ctx.get_help(), err=True)
        sys.exit(ExitCode.INVALID_INPUT)
    where = exc.ctx.command_path if exc.ctx is not None else "headroom"
    typer.echo(f"error: {exc.format_message()} (see '{where} --help')", err=True)
    sys.exit(ExitCode.INVALID_INPUT)


def main() -> None:
    """Console-script entry point."""
    try:
        code = app(standalone_mode=False)
    except click_errors.UsageError as exc:
        _usage_error(exc)
    except click_errors.ClickException as exc:  # a file option click could not open
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:  # Ctrl-C at a prompt
        typer.echo("Aborted.", err=True)
        sys.exit(130)
    except Exception as exc:  # a missing extra, a bad HEADROOM_* setting, an unusable store...
        known = exits.environment_error(exc)
        if known is None:
            raise  # a bug: its traceback is the report
        message, code = known
        typer.echo(f"error: {message}", err=True)
        sys.exit(code)
    if isinstance(code, int) and code:  # typer.Exit(code) under standalone_mode=False
        sys.exit(code)
