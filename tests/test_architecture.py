"""The arrows between Headroom's packages, read from the source with ``ast``.

Every ``.py`` file of each package is parsed and each import statement (at module level or
inside a function: a lazy import is still an arrow) is mapped to the package it names. Each
package may import only the packages listed in ``ALLOWED`` (the command line may import
anything); no package imports a heavy stack its layer must not pull in; and the graph of
packages has no cycle. The planner's own purity (stdlib + pydantic) is held by
``tests/planner/test_import_isolation.py``.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

import headroom

HEADROOM_DIR = Path(headroom.__file__).resolve().parent
#: the packages, each a top-level folder linked as headroom/<name>
PACKAGES = (
    "planner",
    "store",
    "launch",
    "runtime",
    "calibration",
    "api",
    "migrations",
    "hooks",
)
#: the command line: headroom/'s own modules (cli, render, __main__, or a cli/ package)
CLI = "cli"

ALLOWED: dict[str, frozenset[str]] = {
    "planner": frozenset(),
    "store": frozenset({"planner"}),
    "launch": frozenset({"planner", "store", "calibration"}),
    "runtime": frozenset({"planner"}),
    "calibration": frozenset({"planner", "store", "runtime"}),
    "api": frozenset({"planner", "calibration", "store", "launch"}),
    "migrations": frozenset({"store"}),
    # training code imports it: nothing of Headroom's but itself, and no stack at import time
    "hooks": frozenset(),
}

#: third-party stacks a package must not import: the layer below the service stays free of the
#: web stack, everything but the runtime (and calibration, which measures it) free of torch
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "store": frozenset({"torch", "fastapi", "starlette", "uvicorn", "typer"}),
    "launch": frozenset({"torch", "fastapi", "starlette", "uvicorn", "typer"}),
    "api": frozenset({"torch", "typer"}),
    "migrations": frozenset({"torch", "fastapi", "starlette", "uvicorn", "typer"}),
    "runtime": frozenset({"sqlalchemy", "fastapi", "starlette", "uvicorn"}),
    "hooks": frozenset(
        {"torch", "transformers", "lightning", "sqlalchemy", "fastapi", "starlette", "typer"}
    ),
}

#: arrows that exist today: if the scan stops seeing them, it sees nothing
KNOWN_ARROWS = (
    ("api", "launch"),
    ("api", "store"),
    ("launch", "store"),
    ("launch", "calibration"),
    ("store", "planner"),
    ("calibration", "planner"),
    ("runtime", "planner"),
    ("migrations", "store"),
    (CLI, "launch"),
)

Import = tuple[Path, int, str]  # file, line, the module named


def package_files(package: str) -> list[Path]:
    """The ``.py`` files of ``package`` (``cli``: headroom/'s own, not the linked packages)."""
    if package != CLI:
        return sorted((HEADROOM_DIR / package).resolve().rglob("*.py"))
    own = list(HEADROOM_DIR.glob("*.py"))
    cli_dir = HEADROOM_DIR / "cli"
    if cli_dir.is_dir() and not cli_dir.is_symlink():
        own += cli_dir.rglob("*.py")
    return sorted(own)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``; ``from headroom import x`` names
    ``headroom.x``; relative imports stay inside the package and are skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "headroom":
                for alias in node.names:
                    yield node.lineno, f"headroom.{alias.name}"
            else:
                yield node.lineno, node.module


def project_package(module: str) -> str | None:
    """The package ``module`` belongs to (None: not Headroom's)."""
    parts = module.split(".")
    if parts[0] != "headroom":
        return None
    if len(parts) > 1 and parts[1] in PACKAGES:
        return parts[1]
    return CLI


def scan() -> dict[str, dict[str, list[Import]]]:
    """package -> imported package -> where (file, line, module), self-imports left out."""
    graph: dict[str, dict[str, list[Import]]] = {}
    for package in (*PACKAGES, CLI):
        arrows: dict[str, list[Import]] = {}
        for path in package_files(package):
            for line, module in _imports(path):
                target = project_package(module)
                if target is not None and target != package:
                    arrows.setdefault(target, []).append((path, line, module))
        graph[package] = arrows
    return graph


GRAPH = scan()


def _where(found: list[Import]) -> str:
    root = HEADROOM_DIR.parent
    return "; ".join(f"{p.relative_to(root)}:{line} imports {m}" for p, line, m in found)


def test_the_scan_sees_every_package_and_its_imports() -> None:
    for package in (*PACKAGES, CLI):
        assert package_files(package), f"no source files found for {package}"
    for source, target in KNOWN_ARROWS:
        assert target in GRAPH[source], f"the scan no longer sees {source} -> {target}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_packages_below_it(package: str) -> None:
    wrong = {t: found for t, found in GRAPH[package].items() if t not in ALLOWED[package]}
    allowed = ", ".join(sorted(ALLOWED[package])) or "none"
    assert not wrong, f"{package} may import {allowed}; " + "; ".join(
        f"-> {t}: {_where(found)}" for t, found in sorted(wrong.items())
    )


@pytest.mark.parametrize("package", sorted(FORBIDDEN_THIRD_PARTY))
def test_a_package_imports_no_stack_its_layer_must_not_pull_in(package: str) -> None:
    found = [
        (path, line, module)
        for path in package_files(package)
        for line, module in _imports(path)
        if module.split(".")[0] in FORBIDDEN_THIRD_PARTY[package]
    ]
    assert not found, f"{package} must not import {sorted(FORBIDDEN_THIRD_PARTY[package])}: " + (
        _where(found)
    )


def test_the_api_never_imports_the_runtime_or_the_command_line() -> None:
    for target in ("runtime", CLI):
        assert target not in GRAPH["api"], _where(GRAPH["api"][target])


def test_launch_never_imports_the_runtime_the_api_or_the_command_line() -> None:
    for target in ("runtime", "api", CLI):
        assert target not in GRAPH["launch"], _where(GRAPH["launch"][target])


def _cycle(graph: dict[str, dict[str, list[Import]]]) -> list[str] | None:
    """A cycle of packages, as the path that closes it (None: the graph is acyclic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_packages_import_each_other_without_a_cycle() -> None:
    cycle = _cycle(GRAPH)
    assert cycle is None, (
        "import cycle "
        + " -> ".join(cycle)
        + ": "
        + "; ".join(_where(GRAPH[a][b]) for a, b in itertools.pairwise(cycle))
    )


def test_the_cycle_check_finds_a_cycle() -> None:
    here: list[Import] = [(HEADROOM_DIR / "x.py", 1, "headroom.x")]
    assert _cycle({"a": {"b": here}, "b": {"c": here}, "c": {"a": here}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": here}, "b": {}}) is None
