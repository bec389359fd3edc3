"""schemathesis hooks for ``test_schemathesis.py`` (``hooks`` in ``schemathesis.toml``).

One check, run with the others by ``--checks all``: a schema-valid (positive) request may be
refused only for a rule the planner holds and a JSON Schema cannot state, never for its shape;
and every response is tallied (operation, generation mode, status) into the file
``HEADROOM_SCHEMATHESIS_TALLY`` names, for the test to count what reached the handlers.
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

#: pydantic's and the planner's words for a value of the wrong type, range, key or shape
SHAPE_WORDS = ("Input should", "Field required", "unknown field", "Extra inputs", "valid string")


@schemathesis.check
def refused_only_for_planner_rules(ctx: Any, response: Any, case: Any) -> None:
    mode = case.meta.generation.mode.value if case.meta is not None else "explicit"
    problem = response.json() if response.status_code == 422 else {}
    tally = os.environ.get("HEADROOM_SCHEMATHESIS_TALLY")
    if tally:
        row = [case.id, case.operation.label, mode, response.status_code, problem.get("detail")]
        with open(tally, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
    if mode != "positive" or response.status_code != 422:
        return
    if "errors" in problem:  # the request model refused it: the schema let through a bad shape
        raise AssertionError(f"a schema-valid request was refused for its shape: {problem}")
    detail = str(problem.get("detail", ""))
    shape = [word for word in SHAPE_WORDS if word in detail]
    if shape:
        raise AssertionError(
            f"a schema-valid request was refused for its shape ({shape[0]}): {detail}"
        )
