"""Headroom's calibration: measure what training really holds, compare it with the estimate per
bucket, and fit the planner's coefficients to the measurements.

Exported here (no torch, numpy or matplotlib needed to import them):

- the designs the shipped coefficients are traced from (``calibration.design``, data in
  ``calibration/designs/*.json``) and the typed trace records and files
  (``calibration.trace_records``, data in ``calibration/data/*-traces.json``; a framework's
  records and files, ``FrameworkTraceRecord``, add each phase's tracker categories);
- ``compare`` (``calibration.comparison``: a budget against a measurement, per bucket) and
  ``attribute`` (``calibration.attribution``: a probed run's snapshots by what holds them);
- the trust rule (``calibration.trust``).

Import by module, because they need the ``calibration`` extra or torch:
``calibration.regression`` (the least-squares regression of the coefficients, numpy),
``calibration.shipped`` (the shipped sets; ``python -m headroom.calibration.shipped`` rewrites
them), ``calibration.refit`` (``headroom calibrate fit``), ``calibration.report``,
``calibration.tracing`` and ``calibration.collect`` (torch), ``calibration.loss_traces`` (the
loss implementations that run on a CPU: torch, torchtitan, Megatron-Core), ``calibration.hf``
(transformers), ``calibration.frameworks.fsdp2`` (a step under FSDP2 on a fake process group:
torch and transformers; ``calibration.frameworks`` names the frameworks without them).
"""

from headroom.calibration.attribution import attribute
from headroom.calibration.comparison import compare
from headroom.calibration.design import (
    Configuration,
    Design,
    DesignRun,
    DesignShape,
    configurations,
    deepseek_cut,
    load_design,
)
from headroom.calibration.trace_records import (
    FrameworkTraceRecord,
    FrameworkTracesFile,
    TracePeak,
    TraceRecord,
    TracesFile,
    fitted_records,
    load_framework_traces,
    load_traces,
    traces_path,
)
from headroom.calibration.trust import assess, assess_records

__all__ = [
    "Configuration",
    "Design",
    "DesignRun",
    "DesignShape",
    "FrameworkTraceRecord",
    "FrameworkTracesFile",
    "TracePeak",
    "TraceRecord",
    "TracesFile",
    "assess",
    "assess_records",
    "attribute",
    "compare",
    "configurations",
    "deepseek_cut",
    "fitted_records",
    "load_design",
    "load_framework_traces",
    "load_traces",
    "traces_path",
]
