"""Wheels for a GPU host that has CUDA PyTorch and no network.

A GPU image usually carries PyTorch (with its own requirements and numpy) and little else, and a
training cluster's nodes often cannot reach a package index. The GPU measurements
(``bench/runtime_gpu.py``, ``bench/calibration_gpu.py``, ``headroom calibrate run``,
``headroom train``) import the distributions in ``GPU_PATH`` besides PyTorch; this script
downloads them, at the versions installed here (the versions the tests ran with), as binary
wheels for the host's Python and platform:

  here:   .venv/bin/python bench/wheelhouse.py --python-version 3.12 --dest .wheelhouse
  there:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheelhouse/*.whl
          export PYTHONPATH=/tmp/site:$PWD

``tests/runtime/test_gpu_host.py`` runs the GPU path on the CPU and fails if it imports a
distribution that is neither PyTorch's nor listed here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

# What the GPU path imports besides torch, its requirements and numpy (with what they need).
GPU_PATH = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "pydantic-settings",
    "python-dotenv",
    "SQLAlchemy",
    "alembic",
    "Mako",
    "MarkupSafe",
    "PyYAML",
    "typer",
    "annotated-doc",
    "shellingham",
    "rich",
    "markdown-it-py",
    "mdurl",
    "Pygments",
    "nvidia-ml-py",
)
# What a CUDA PyTorch image brings with torch itself.
WITH_TORCH = ("torch", "numpy")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def torch_side() -> set[str]:
    """Normalised names of the distributions that come with PyTorch."""
    names = set(WITH_TORCH)
    for req in importlib.metadata.requires("torch") or []:
        if "extra ==" not in req:
            names.add(_name_of(req))
    return {normalise(n) for n in names}


def _name_of(requirement: str) -> str:
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            return requirement[:i]
    return requirement


def normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pins() -> list[str]:
    """``name==version`` of every GPU_PATH distribution, as installed in this environment."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in GPU_PATH]


def download_argv(python_version: str, dest: Path) -> list[str]:
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    argv += ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version]
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    return [*argv, "-d", str(dest), *pins()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--python-version", default="3.12", help="the GPU host's Python (X.Y)")
    parser.add_argument("--dest", type=Path, default=Path(".wheelhouse"))
    parser.add_argument("--list", action="store_true", help="print the pins; download nothing")
    args = parser.parse_args()
    if args.list:
        print("\n".join(pins()))
        return
    args.dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(download_argv(args.python_version, args.dest), check=True)
    wheels = sorted(p.name for p in args.dest.glob("*.whl"))
    size = sum(p.stat().st_size for p in args.dest.glob("*.whl"))
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.dest}")


if __name__ == "__main__":
    main()
