"""An input object with thousands of unknown keys is one error, not thousands: pydantic made an
error per key (0.3 s of CPU for 50,000 of them, to name ten). A few are still named one by
one, and lists are refused by their length before their items are read."""

from __future__ import annotations

from typing import Any

import pytest

from headroom import planner
from headroom.planner._keys import MAX_UNKNOWN_KEYS

GPU: dict[str, Any] = {
    "name": "g",
    "memory_bytes": 1 << 30,
    "bf16_flops": 1e12,
    "memory_bandwidth_bytes_per_s": 1e12,
    "host_link": "PCIe",
    "host_link_bytes_per_s": 1e10,
    "cuda_context_bytes": 0,
    "allocator_overhead_fraction": 0.1,
}


def _keys(n: int) -> dict[str, int]:
    return {f"k{i}": i for i in range(n)}


@pytest.mark.parametrize(
    ("load", "data", "field", "unknown"),
    [
        (planner.load_train, _keys(50_000), "train", 50_000),
        (planner.load_train, {"parallel": _keys(50_000)}, "train.parallel", 50_000),
        (planner.load_train, {"offload": {"mode": "none", **_keys(999)}}, "train.offload", 999),
        (planner.load_model, {"name": "m", **_keys(50_000)}, "model", 50_000),
        (planner.load_hardware, {**GPU, **_keys(50_000)}, "gpu", 50_000),
    ],
    ids=["train", "train.parallel", "train.offload", "model", "gpu"],
)
def test_thousands_of_unknown_keys_are_one_error_naming_the_object(
    load: Any, data: dict[str, Any], field: str, unknown: int
) -> None:
    with pytest.raises(planner.SpecError) as raised:
        load(data)
    assert raised.value.field == field
    message = str(raised.value)
    named = "('k0', 'k1', 'k2', 'k3', 'k4', …)"
    assert message.startswith(f"{field}: {unknown} unknown fields {named}")
    assert "; allowed: " in message and len(message) < 1000


def test_a_few_unknown_keys_are_still_named_one_by_one() -> None:
    with pytest.raises(planner.SpecError) as raised:
        planner.load_train({"parallel": _keys(MAX_UNKNOWN_KEYS)})
    assert raised.value.field == "train.parallel.k0"
    assert str(raised.value).startswith("train.parallel.k0: unknown field; ")


def test_a_gpu_with_too_many_aliases_is_refused_before_they_are_read() -> None:
    with pytest.raises(planner.SpecError) as raised:
        planner.load_hardware({**GPU, "aliases": [None] * 100_000})
    assert raised.value.field == "gpu.aliases"
    assert str(raised.value) == "gpu.aliases: at most 32 aliases, got 100000"
    assert planner.load_hardware({**GPU, "aliases": ["a", "b"]}).aliases == ("a", "b")
