"""Prometheus metrics: request metrics from the instrumentator plus the planner's own counters.

Each application gets its own registry, so tests can build many apps in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class Metrics:
    """The service's domain counters, in one registry shared with the request metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.estimates = Counter(
            "headroom_estimates", "Estimates computed", ["endpoint"], registry=self.registry
        )
        self.verdicts = Counter(
            "headroom_verdicts", "Fit verdicts returned", ["fits"], registry=self.registry
        )
        self.calibrations = Counter(
            "headroom_calibrations", "Calibration records stored", registry=self.registry
        )
        self.probes = Counter(
            "headroom_probes", "Probe runs of the trainer", ["outcome"], registry=self.registry
        )
        self.ooms = Counter(
            "headroom_ooms", "Runs or probes that ran out of memory", registry=self.registry
        )
