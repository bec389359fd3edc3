"""Headroom's launch layer: how a plan becomes a run of the bundled trainer, and what it did.

- ``plan``: a run's validated specs and their estimate (``RunPlan``, ``plan_run``), stored as
  a queued run (``queue_run``);
- ``transitions``: every change of a run's state, named (claim, finish, cancel, ...);
- ``supervisor``: the ``Supervisor`` that claims queued runs, starts and watches them, and
  reconciles the runs a stopped service left running;
- ``rundirs``: a run's private directory, the ending kept there, and its retention;
- ``backends``: the ``Launcher`` protocol and its ``local`` and ``torchrun`` backends;
- ``slurm``: a run as a Slurm batch job (``backend: slurm``), its state, its cancel, its end;
- ``k8s``: a plan rendered as a Kubeflow PyTorchJob and its specs' ConfigMap, for kubectl;
- ``probing``: the probe ladder (``autofit``): fit, probe into step 2, step down on OOM;
- ``probe_process``: a run's probe ladder as a process of the run's own, where it trains;
- ``recording``: each probe kept as a calibration record;
- ``devices``: this host's GPUs and RAM;
- ``settings``: ``LaunchSettings``, where runs go (``HEADROOM_RUN_DIR``, ``HEADROOM_RUN_DEVICE``,
  ``HEADROOM_MAX_RUNNING``, ``HEADROOM_RUN_RETENTION_DAYS``) on top of the store's
  ``HEADROOM_DATABASE_URL``.

The command line and the service both call it. It imports the planner, the store and
calibration, never the runtime (it starts the trainer as a process), the service or the CLI.
"""

from headroom.launch.backends import BACKENDS, EXIT_OOM, Launcher, describe_exit, launcher
from headroom.launch.devices import local_gpus, resolve_device
from headroom.launch.plan import NoPlanFits, Prediction, RunPlan, plan_run, queue_run
from headroom.launch.probing import AutoFitResult, ProbeOutcome, ProbeRecord, autofit
from headroom.launch.recording import probe_recorder
from headroom.launch.rundirs import inside_run_dir, removed_by_retention
from headroom.launch.settings import LaunchSettings
from headroom.launch.supervisor import Supervisor, cancel, report_of

__all__ = [
    "BACKENDS",
    "EXIT_OOM",
    "AutoFitResult",
    "LaunchSettings",
    "Launcher",
    "NoPlanFits",
    "Prediction",
    "ProbeOutcome",
    "ProbeRecord",
    "RunPlan",
    "Supervisor",
    "autofit",
    "cancel",
    "describe_exit",
    "inside_run_dir",
    "launcher",
    "local_gpus",
    "plan_run",
    "probe_recorder",
    "queue_run",
    "removed_by_retention",
    "report_of",
    "resolve_device",
]
