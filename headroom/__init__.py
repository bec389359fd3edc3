"""Headroom: will this training run fit, where does every byte go, and what fits instead.

One import package; each subpackage is a top-level folder of the repository, linked here:

- ``headroom.planner``: the estimator, the auto-fit search and the gate (stdlib + pydantic);
- ``headroom.store``: the tables and record functions (SQLAlchemy, migrated by
  ``headroom.migrations``);
- ``headroom.launch``: launcher backends, the run supervisor and its state transitions, the probe
  ladder;
- ``headroom.runtime``: the bundled streaming-offload trainer (torch);
- ``headroom.calibration``: traces, comparisons, the coefficient regression;
- ``headroom.api``: the REST service and the budget page (FastAPI);
- ``headroom.cli``: the ``headroom`` command.

``docs/ARCHITECTURE.md`` draws the arrows between them.
"""

__version__ = "0.1.0"

__all__: list[str] = []
