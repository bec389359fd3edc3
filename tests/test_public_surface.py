"""Each package's public surface is explicit: its ``__init__`` lists what it exports in a sorted
``__all__`` that names exactly its public attributes, and no module shares its name with a
function or class it defines (``planner.estimate`` is a function; the estimator lives in
``planner.estimator``), so a name from an ``__init__`` leads to one thing.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import os
import pkgutil
import types
from pathlib import Path

import pytest

import headroom

PACKAGES = (
    "headroom",
    "headroom.planner",
    "headroom.store",
    "headroom.launch",
    "headroom.runtime",
    "headroom.calibration",
    "headroom.api",
    "headroom.cli",
    "headroom.migrations",
)


def _ruff_order(name: str) -> tuple[int, str]:
    """ruff's order for ``__all__`` (RUF022, isort-style): constants, classes, the rest."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2), name


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_names_every_public_attribute(name: str) -> None:
    package = importlib.import_module(name)
    exported = package.__all__
    assert exported == sorted(exported, key=_ruff_order), f"{name}.__all__ is not sorted"
    public = {
        attr
        for attr, value in vars(package).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType | __future__._Feature)
    }
    assert set(exported) == public, f"{name}: __all__ and the public attributes differ"


@pytest.mark.parametrize("name", PACKAGES)
def test_no_export_is_also_a_module_name(name: str) -> None:
    package = importlib.import_module(name)
    modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert not modules & set(package.__all__), f"{name} exports a name that is also a module"


def _module_files() -> list[Path]:
    root = Path(headroom.__file__).parent
    return sorted(
        Path(folder) / name
        for folder, _, names in os.walk(root, followlinks=True)  # the packages are links
        for name in names
        if name.endswith(".py") and name != "__init__.py" and "versions" not in Path(folder).parts
    )


def test_no_module_defines_a_function_or_class_named_as_the_module() -> None:
    files = _module_files()
    assert len(files) > 60, files  # the scan sees the packages behind the links
    clashes = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            defines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            if isinstance(node, defines) and node.name == path.stem:
                clashes.append(f"{path.relative_to(Path(headroom.__file__).parent)}: {node.name}")
    assert clashes == []
