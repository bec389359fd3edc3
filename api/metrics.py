"""Prometheus metrics: request metrics from the instrumentator plus the planner's own counters.

Each application gets its own registry, so tests can build many apps in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


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
        self.searches = Counter(
            "headroom_searches",
            "Plan and fit searches by outcome: done, invalid (422), queue_full (503, not "
            "queued), client_gone (its client left while it waited: never started), cancelled "
            "(its client left while it ran: stopped), deadline (stopped at its deadline: 503)",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.searches_waiting = Gauge(
            "headroom_searches_waiting",
            "Plan and fit searches waiting for the search thread",
            registry=self.registry,
        )
        self.searches_running = Gauge(
            "headroom_searches_running", "Plan and fit searches running", registry=self.registry
        )
