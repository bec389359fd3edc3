"""``pip install headroom-planner`` without extras: the gate and the estimator, and nothing else.

Builds the wheel from a copy of the sources, installs it with its base dependencies only into a
fresh virtual environment (no system site packages), and checks that the web, database and torch
packages are absent there, that ``headroom gate`` and ``headroom estimate`` still give their exit
codes, and that the wheel adds one top-level package, ``headroom``, so it cannot shadow another
distribution's ``api`` or ``runtime``. The base dependencies come from the package index pip is
configured with: when it cannot be reached the test fails, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

import processes
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what the wheel is built from (pyproject's package folders, linked under headroom/)
SOURCES = (
    "pyproject.toml",
    "README.md",
    "headroom",
    "planner",
    "runtime",
    "calibration",
    "api",
    "migrations",
    "store",
    "launch",
)
#: what the extras add, none of it installed by the base dependencies
EXTRAS_ONLY = (
    "fastapi",
    "uvicorn",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "pydantic_settings",
    "torch",
    "numpy",
    "matplotlib",
    "transformers",
)
#: the top-level folders the project keeps, shipped only as headroom.<name>
NOT_TOP_LEVEL = ("api", "runtime", "migrations", "planner", "calibration", "store", "launch")


def _clean_env() -> dict[str, str]:
    """This environment without what would lead the venv's interpreter back to this checkout."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTHON") and k not in ("VIRTUAL_ENV", "PIP_USER")
    }


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``args`` bound: past ``timeout`` it and what it started (pip's build backend) are
    killed."""
    return processes.run(args, cwd=cwd, env=_clean_env(), timeout=timeout)


def _build_wheel(tmp: Path) -> Path:
    """The wheel, built from a copy so the checkout gets no build/ or egg-info."""
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.db")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = tmp / "wheel"
    # this interpreter's setuptools builds it (no isolated build environment to download)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = _run([*pip_wheel, "-w", str(out), str(src)], cwd=tmp)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = out.glob("headroom_planner-*.whl")
    return wheel


@pytest.fixture(scope="module")
def slim(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the bin/ folder of a venv that has it installed with no extras)."""
    tmp = tmp_path_factory.mktemp("slim")
    wheel = _build_wheel(tmp)
    env_dir = tmp / "venv"
    # no pip inside: this interpreter's pip installs into it (--python), which saves ensurepip
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    proc = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", str(wheel)],
        cwd=tmp,
    )
    if proc.returncode != 0:
        pytest.fail(
            "installing the wheel's base dependencies failed; is the package index pip is "
            f"configured with reachable?\n{proc.stdout}\n{proc.stderr}",
            pytrace=False,
        )
    return wheel, env_dir / "bin"


def test_the_wheel_ships_one_top_level_package(slim: tuple[Path, Path]) -> None:
    wheel, _ = slim
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert zf.read(top_level).decode().split() == ["headroom"]
    assert {n.split("/")[0] for n in names} == {"headroom", top_level.split("/")[0]}
    for name in NOT_TOP_LEVEL:
        assert f"headroom/{name}/__init__.py" in names  # shipped, under headroom


def test_the_distribution_is_not_the_package_indexs_other_headroom(slim: tuple[Path, Path]) -> None:
    """The index's ``headroom`` (0.2.x) is another project: ours ships as ``headroom-planner``, with
    the ``headroom`` command and import package."""
    wheel, bin_dir = slim
    assert wheel.name.startswith("headroom_planner-")
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        lines = zf.read(metadata).decode().splitlines()
    assert "Name: headroom-planner" in lines
    extras = {line.split(": ", 1)[1] for line in lines if line.startswith("Provides-Extra: ")}
    assert {"service", "runtime", "calibration", "hf", "dev"} <= extras
    # an extra that names the project names it by its own distribution, not the index's other one
    requires = [line for line in lines if line.startswith("Requires-Dist: headroom")]
    assert requires and all(r.startswith("Requires-Dist: headroom-planner[") for r in requires)
    assert (bin_dir / "headroom").exists()


def _make_dry_run(target: str) -> str:
    """What ``make TARGET`` would run on a checkout with no .venv (``make -n`` in a copy of the
    Makefile and pyproject.toml)."""
    with_tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    work = Path(tempfile.mkdtemp(dir=with_tmp))
    try:
        for name in ("Makefile", "pyproject.toml"):
            shutil.copy(ROOT / name, work / name)
        proc = subprocess.run(
            ["make", "-n", target], cwd=work, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_make_run_installs_the_service_extra_only_and_make_test_everything() -> None:
    run = _make_dry_run("run")
    installs = [line for line in run.splitlines() if "pip install" in line]
    assert any('-e ".[service]"' in line for line in installs), run
    for heavy in ("torch", "[dev]", "deepspeed", "torchtitan", "megatron"):
        assert not any(heavy in line for line in installs), (heavy, run)
    assert "headroom serve --host 127.0.0.1 --port 8000" in run
    install = _make_dry_run("install")
    assert '-e ".[dev]"' in install and "torch==2.13.0" in install
    # tyro before torchtitan's --no-deps install, so no resolver report of what --no-deps left out
    assert install.index("tyro==") < install.index("torchtitan==")
    # the suite on three workers, then the tests that assert a wall-clock bound alone
    pytest_lines = [line for line in _make_dry_run("pytest").splitlines() if "-m pytest" in line]
    assert len(pytest_lines) == 2, pytest_lines
    assert "-n 3 --dist loadgroup" in pytest_lines[0] and '-m "not timing"' in pytest_lines[0]
    assert pytest_lines[1].endswith("-m pytest -q -m timing")


def test_the_base_install_leaves_the_extras_out(slim: tuple[Path, Path]) -> None:
    _, bin_dir = slim
    probe = (
        "import importlib.util, json, headroom; print(json.dumps({'headroom': headroom.__file__, "
        f"'found': [m for m in {(*EXTRAS_ONLY, *NOT_TOP_LEVEL)!r} "
        "if importlib.util.find_spec(m) is not None]}))"
    )
    proc = _run([str(bin_dir / "python"), "-I", "-c", probe], cwd=bin_dir)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["found"] == []
    assert Path(out["headroom"]).is_relative_to(bin_dir.parent)  # not this checkout


@pytest.mark.parametrize(
    ("args", "code", "decision"),
    [
        (["gate", "tiny-dense", "--gpu", "H100-80GB", "--format", "json"], 0, "fits"),
        (["gate", "llama-3-70b", "--gpu", "RTX-4090", "--format", "json"], 1, "oom"),
        (["gate", "tiny-dense", "--require-calibration", "--format", "json"], 3, "undecided"),
    ],
)
def test_gate_runs_without_the_extras(
    slim: tuple[Path, Path], args: list[str], code: int, decision: str
) -> None:
    _, bin_dir = slim
    proc = _run([str(bin_dir / "headroom"), *args], cwd=bin_dir.parent, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert json.loads(proc.stdout)["decision"] == decision


def test_estimate_and_fit_run_without_the_extras(slim: tuple[Path, Path]) -> None:
    _, bin_dir = slim
    headroom = str(bin_dir / "headroom")
    train = bin_dir.parent / "train.yaml"  # a YAML spec: pyyaml is a base dependency
    train.write_text("micro_batch_size: 2\nrecompute: full\n")
    proc = _run(
        [headroom, "estimate", "llama-3-8b", "--train", str(train), "--format", "json"],
        cwd=bin_dir.parent,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"]["name"] == "llama-3-8b"
    proc = _run([headroom, "estimate", "tiny-dense"], cwd=bin_dir.parent, timeout=120)
    assert proc.returncode == 0 and "tiny-dense" in proc.stdout, proc.stderr
    proc = _run(
        [headroom, "estimate", "tiny-dense", "--set", "micro_batch_size=0"],
        cwd=bin_dir.parent,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: train.micro_batch_size")
    proc = _run(
        [headroom, "fit", "deepseek-v3", "--gpu", "RTX-3090", "--host-memory", "64GiB"],
        cwd=bin_dir.parent,
        timeout=120,
    )
    assert proc.returncode == 1 and "no candidate fits" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["serve", "--port", "1"], "pip install 'headroom-planner[service]'"),
        (["calibrate", "report"], "pip install 'headroom-planner[calibration]'"),
        (["train", "tiny-dense"], "install the torch build your machine needs"),
    ],
)
def test_a_command_whose_extra_is_missing_names_it(
    slim: tuple[Path, Path], args: list[str], extra: str
) -> None:
    _, bin_dir = slim
    proc = _run([str(bin_dir / "headroom"), *args], cwd=bin_dir.parent, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and extra in proc.stderr
    assert "Traceback" not in proc.stderr
