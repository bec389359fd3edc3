"""The planner's public surface: ``__all__`` is sorted (as ruff sorts it) and names exactly
what ``__init__`` exports; no module shares its name with a function it exports
(``planner.estimate`` is the function, the estimator lives in ``planner.estimator``); and the
named terms line up with the bucket and phase names the Budget shows."""

from __future__ import annotations

import pkgutil
import types

from headroom import planner
from headroom.planner.activations import BackwardPoint
from headroom.planner.budget import HOST_BUCKETS, PHASES
from headroom.planner.states import HostBytes


def _isort_style(name: str) -> tuple[int, str]:
    """ruff's order for ``__all__`` (RUF022): constants, then classes, then the rest."""
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return kind, name


def test_all_is_sorted_and_complete() -> None:
    assert planner.__all__ == sorted(planner.__all__, key=_isort_style)
    public = {
        name
        for name, value in vars(planner).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(planner.__all__) == public


def test_no_module_shares_its_name_with_an_export() -> None:
    modules = {m.name for m in pkgutil.iter_modules(planner.__path__)}
    assert not modules & set(planner.__all__)
    for name in ("estimate", "evaluate", "explain", "fit", "gate", "knobs"):
        assert callable(getattr(planner, name)), name


def test_named_terms_follow_the_reported_names() -> None:
    assert HostBytes._fields == HOST_BUCKETS
    assert planner.PHASES == PHASES
    # the search's hot loop unpacks a point in this order
    assert BackwardPoint._fields == (
        "dense_layers",
        "moe_layers",
        "activations",
        "dispatch",
        "is_moe",
    )
