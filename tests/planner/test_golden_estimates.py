"""Every preset, every committed calibration record and the ladder estimate exactly as recorded.

``data/golden-estimates.json`` is the planner's output before its terms were named; a change of
structure must not move a byte. Regenerate it (``python tests/golden.py --write``) only
for an intended change of an estimate, and say so in the commit.
"""

from __future__ import annotations

import json
from typing import Any

import golden


def _diff(expected: Any, got: Any, path: str = "") -> list[str]:
    if isinstance(expected, dict) and isinstance(got, dict):
        out = [f"{path}/{k}: missing" for k in expected.keys() - got.keys()]
        out += [f"{path}/{k}: unexpected" for k in got.keys() - expected.keys()]
        for key in expected.keys() & got.keys():
            out += _diff(expected[key], got[key], f"{path}/{key}")
        return out
    if isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        return [
            d
            for i, (e, g) in enumerate(zip(expected, got, strict=True))
            for d in _diff(e, g, f"{path}[{i}]")
        ]
    return [] if expected == got else [f"{path}: {expected!r} -> {got!r}"]


def test_estimates_are_byte_identical_to_the_golden_file() -> None:
    expected = json.loads(golden.GOLDEN.read_text())
    got = json.loads(json.dumps(golden.snapshot()))
    assert len(expected["presets"]) > 200 and len(expected["records"]) > 150
    differences = _diff(expected, got)
    assert not differences, f"{len(differences)} differences, first: {differences[:10]}"
