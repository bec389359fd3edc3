"""The heaviest ``/plan`` body found (every size highly divisible: 844,928 layouts, 87 s of CPU
and 860 MiB before the search was bounded), shared by the tests of its refusal and by
``bench/api_cost.py``, which reads the same file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORST_PLAN_FILE = Path(__file__).resolve().parents[1] / "bench" / "bodies" / "worst-plan.json"


def worst_plan() -> dict[str, Any]:
    """The body, as posted to ``/plan`` (its ``model`` is a custom model's spec)."""
    body: dict[str, Any] = json.loads(WORST_PLAN_FILE.read_text())
    return body
