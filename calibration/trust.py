"""The trust rule: how far recent measurements say a coefficient set can be believed.

The recent measurements of a profile on a device (the newest :data:`RECENT` calibration records
of that profile and GPU) are predicted again with the coefficients in question, so a refit is
judged by what it would have said, not by what older coefficients said when each record was
made. Where at least :data:`MIN_RECORDS` of them were predicted within :data:`WITHIN` of what was
measured, the set is *trusted* and its margin covers the worst under-prediction seen: local
measurements of the user's own stack outweigh the published runs behind the default margin.
Otherwise the margin widens with the observed error, to the worst under-prediction plus
:data:`WITHIN` (rounded up to a whole percent), and is never below the coefficients' own
(the default, ``planner.coefficients.DEFAULT_MARGIN_FRACTION``: what the published GPU runs
support). With no measurements at all the set is untrusted and keeps that margin.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

from headroom import planner
from headroom.calibration.comparison import compare, measured_stage
from headroom.planner.measurement import Measurement

#: recent predictions within this relative error make a set trusted
WITHIN = 0.05
#: how many of the newest records of a profile on a device are looked at
RECENT = 20
#: fewer measurements than this never make a set trusted
MIN_RECORDS = 3
#: the widest margin the rule sets (past it a plan needs measuring, not a margin)
MAX_MARGIN = 0.5


def record_error(
    spec: dict[str, Any], measured: dict[str, Any], coeffs: planner.Coefficients
) -> float:
    """(predicted - measured) / measured of one stored record under ``coeffs``, like with like
    (the figure the record measured: allocated, reserved or nvidia-smi's)."""
    model = planner.ModelSpec.model_validate(spec["model"])
    train = planner.TrainSpec.model_validate(spec["train"])
    hw = planner.Hardware.model_validate(spec["hardware"])
    budget = planner.estimate(model, train, hw, coeffs)
    kept = {
        k: measured.get(k)
        for k in ("allocated_bytes", "reserved_bytes", "nvidia_smi_bytes", "phase", "stage")
    }
    figures = Measurement(**kept)
    comparison = compare(budget, figures, measured_stage(figures, model, train, hw, coeffs))
    return float(comparison["relative_error"])


def assess(coeffs: planner.Coefficients, errors: Sequence[float]) -> planner.Coefficients:
    """``coeffs`` with the trust rule's verdict, observed error and margin (module docstring)."""
    under = max([0.0, *(-e for e in errors)])
    worst = max([0.0, *(abs(e) for e in errors)])
    trusted = len(errors) >= MIN_RECORDS and worst <= WITHIN
    if trusted:
        margin = under
        verdict = f"trusted: {len(errors)} recent measurement(s) within {worst:.1%}"
    else:
        margin = max(coeffs.margin_fraction, math.ceil((under + WITHIN) * 100 - 1e-9) / 100)
        verdict = (
            f"untrusted: {len(errors)} recent measurement(s), worst {worst:.1%}"
            if errors
            else "untrusted: no recent measurements"
        )
    margin = min(margin, MAX_MARGIN)
    return coeffs.model_copy(
        update={
            "trusted": trusted,
            "observed_error": -under if errors else None,
            "recent_records": len(errors),
            "margin_fraction": margin,
            "source": f"{coeffs.source}; {verdict}, margin {margin:.0%}",
        }
    )


def assess_records(
    coeffs: planner.Coefficients, records: Iterable[tuple[dict[str, Any], dict[str, Any]]]
) -> planner.Coefficients:
    """:func:`assess` over (spec, measured) pairs of stored records, newest first."""
    newest = itertools.islice(records, RECENT)
    return assess(coeffs, [record_error(spec, measured, coeffs) for spec, measured in newest])
