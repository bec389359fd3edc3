"""The estimator's named terms line up with the bucket and phase names the Budget shows (the
package-wide surface rules are ``tests/test_public_surface.py``)."""

from __future__ import annotations

from headroom import planner
from headroom.planner.activations import BackwardPoint
from headroom.planner.budget import HOST_BUCKETS, PHASES
from headroom.planner.states import HostBytes


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
        "edge",
    )
