"""How good the estimate is: per-bucket error statistics over every measurement, the false-fit
count, and a plot of predicted against measured peaks.

Sources: the committed traces (``calibration/data/{runtime,hf}-traces.json`` and the framework
traces, ``hf-fsdp2-traces.json``, compared with the coefficients shipped today) and every
calibration record in the store (each compared with the estimate made when it was recorded).
The peak's error is also given per (implementation, framework) pair: an estimate is as good as
the evidence for the model code and the framework it runs under. A false fit is a probe
predicted to fit that ran out of memory: the one error the estimator must not make.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from headroom import planner
from headroom.calibration.comparison import compare_trace
from headroom.calibration.design import FRAMEWORK_DESIGNS
from headroom.calibration.regression import TRACE_DEVICE
from headroom.calibration.shipped import ABOUT
from headroom.calibration.trace_records import TracesFile, load_framework_traces, traces_path

#: the committed traces, per implementation
COMMITTED = tuple(traces_path(profile) for profile in ABOUT)
BUCKETS = ("params", "grads", "optimizer_states")


def committed_points() -> list[dict[str, Any]]:
    """The committed traces against today's estimate of their profile."""
    records = [
        r for path in COMMITTED for r in TracesFile.model_validate_json(path.read_text()).records
    ]
    out = []
    for r in records:
        budget = planner.estimate(r.model, r.train, TRACE_DEVICE)
        row = budget.gpu.phases[budget.peak_phase].buckets
        buckets: dict[str, tuple[int, int]] = {}
        if r.peak is not None:
            buckets["params"] = (row["params"] + row["master_params"], r.peak.params)
            buckets["optimizer_states"] = (row["optimizer_states"], r.peak.optimizer_states)
        out.append(
            {
                "source": "trace (committed)",
                "model": r.model.name,
                "pair": _pair(r.train.activation_profile, r.train.framework),
                "predicted_peak_bytes": budget.gpu_peak_bytes,
                "measured_peak_bytes": r.peak_bytes,
                "buckets": buckets,
                "false_fit": False,
            }
        )
    out += _framework_points()
    return out


def _pair(profile: str, framework: str) -> str:
    return f"{profile} / {framework}"


def _framework_points() -> list[dict[str, Any]]:
    """The committed FSDP2 traces against today's estimate: allocated bytes of its peak phase
    against the traced peak (a CPU trace has no CUDA context or allocator overhead)."""
    records = [
        r
        for design in FRAMEWORK_DESIGNS
        for traces in [load_framework_traces(design)]
        for r in (traces.records if traces is not None else ())
    ]
    out = []
    for r in records:
        assert r.peak is not None
        compared = compare_trace(
            planner.estimate(r.model, r.train, TRACE_DEVICE), {"peak": r.peak.model_dump()}
        )
        out.append(
            {
                "source": "trace (committed)",
                "model": r.model.name,
                "pair": _pair(r.train.activation_profile, r.train.framework),
                "predicted_peak_bytes": compared["predicted_peak_bytes"],
                "measured_peak_bytes": compared["measured_peak_bytes"],
                "buckets": {},
                "false_fit": False,
            }
        )
    return out


def store_points(rows: list[Any]) -> list[dict[str, Any]]:
    """Calibration records (``headroom.store.Calibration`` rows) as report points."""
    out = []
    for row in rows:
        comparison = row.predicted.get("comparison", {})
        fits = bool(row.predicted.get("budget", {}).get("fits"))
        out.append(
            {
                "source": row.source,
                "model": row.model_name,
                "pair": _pair(row.activation_profile, row.framework),
                "predicted_peak_bytes": row.predicted_peak_bytes,
                "measured_peak_bytes": row.measured_peak_bytes,
                "buckets": {
                    name: (b["predicted"], b["measured"])
                    for name, b in comparison.get("buckets", {}).items()
                },
                "false_fit": row.source == "probe" and fits and "out of memory" in row.notes,
            }
        )
    return out


def _stats(errors: list[float]) -> dict[str, Any]:
    if not errors:
        return {"n": 0, "median": None, "p95": None, "max": None}
    magnitudes = sorted(abs(e) for e in errors)
    p95 = magnitudes[min(len(magnitudes) - 1, round(0.95 * (len(magnitudes) - 1)))]
    return {
        "n": len(errors),
        "median": statistics.median(magnitudes),
        "p95": p95,
        "max": magnitudes[-1],
        "signed_mean": statistics.fmean(errors),
    }


def summarise(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, p95 and max |relative error| per bucket and at the peak; false fits."""

    def rel(p: int, m: int) -> float | None:
        return (p - m) / m if m else None

    peak = [
        e
        for pt in points
        if (e := rel(pt["predicted_peak_bytes"], pt["measured_peak_bytes"])) is not None
    ]
    buckets: dict[str, Any] = {}
    for name in BUCKETS:
        errors = [
            e
            for pt in points
            if name in pt["buckets"] and (e := rel(*pt["buckets"][name])) is not None
        ]
        buckets[name] = _stats(errors)
    pairs = {
        pair: _stats(
            [
                e
                for pt in points
                if pt["pair"] == pair
                and (e := rel(pt["predicted_peak_bytes"], pt["measured_peak_bytes"])) is not None
            ]
        )
        for pair in sorted({pt["pair"] for pt in points})
    }
    return {
        "points": len(points),
        "peak": _stats(peak),
        "buckets": buckets,
        "by_pair": pairs,
        "false_fits": sum(pt["false_fit"] for pt in points),
    }


def plot(points: list[dict[str, Any]], path: Path) -> None:
    """Predicted against measured peaks, one marker per source, with the y = x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for source in sorted({p["source"] for p in points}):
        mine = [p for p in points if p["source"] == source]
        ax.scatter(
            [p["measured_peak_bytes"] / 2**20 for p in mine],
            [p["predicted_peak_bytes"] / 2**20 for p in mine],
            label=f"{source} ({len(mine)})",
            s=18,
        )
    values = [
        v / 2**20 for p in points for v in (p["measured_peak_bytes"], p["predicted_peak_bytes"])
    ]
    if values:
        low, high = min(values) * 0.8, max(values) * 1.25
        ax.plot([low, high], [low, high], color="grey", linewidth=1, label="predicted = measured")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title("Headroom: predicted vs measured peak")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    # the format named, not guessed from the suffix: matplotlib would append ".png" to a name
    # without one and write another format for another suffix
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
