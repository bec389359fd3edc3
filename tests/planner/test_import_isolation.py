"""The planner stays stdlib + pydantic: no torch, web or database stack is imported, at import
time or while estimating, and no source file has an import statement for anything else."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from headroom import planner

FORBIDDEN = ("torch", "sqlalchemy", "fastapi", "numpy")
ALLOWED_THIRD_PARTY = {
    "pydantic",
    "headroom.planner",
    "pydantic_core",
    "typing_extensions",
    "annotated_types",
}
PLANNER_DIR = Path(planner.__file__).resolve().parent

_SCRIPT = """
import json, sys
from headroom import planner
after_import = sorted(m for m in {forbidden!r} if m in sys.modules)
budget = planner.estimate(planner.load_model("mixtral-8x7b"), planner.TrainSpec(),
                          planner.gpu("H100-80GB"))
assert budget.gpu.peak_bytes > 0
after_estimate = sorted(m for m in {forbidden!r} if m in sys.modules)
print(json.dumps({{"after_import": after_import, "after_estimate": after_estimate,
                  "file": planner.__file__}}))
"""


def test_import_and_estimate_load_no_heavy_modules() -> None:
    code = _SCRIPT.format(forbidden=FORBIDDEN)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PLANNER_DIR.parent,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve().parent == PLANNER_DIR
    assert result["after_import"] == []
    assert result["after_estimate"] == []


def _imported_top_level(path: Path) -> set[str]:
    """What ``path`` imports: top-level names, and ``headroom.<package>`` for the project's own."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(_package(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: inside the planner package
                names.add("headroom.planner")
            elif node.module == "headroom":
                names.update(f"headroom.{alias.name}" for alias in node.names)
            elif node.module:
                names.add(_package(node.module))
    return names


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "headroom" and len(parts) > 1 else parts[0]


def test_source_imports_only_stdlib_and_pydantic() -> None:
    files = sorted(PLANNER_DIR.glob("*.py"))
    assert files, PLANNER_DIR
    allowed = set(sys.stdlib_module_names) | ALLOWED_THIRD_PARTY
    offenders = {
        path.name: sorted(extra) for path in files if (extra := _imported_top_level(path) - allowed)
    }
    assert offenders == {}


def test_ast_scan_sees_imports() -> None:
    # Guard against a scan that silently finds nothing.
    assert "pydantic" in _imported_top_level(PLANNER_DIR / "model.py")
    io_imports = _imported_top_level(PLANNER_DIR / "io.py")
    assert {"importlib", "json", "headroom.planner"} <= io_imports
    # The lazy PyYAML import is a call, not an import statement.
    assert "yaml" not in io_imports
