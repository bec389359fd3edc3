"""``scripts/venv-ready.sh``, which every install of the Makefile starts with: a virtualenv
whose installs were stopped part-way is made again, not trusted.

A SIGTERM 49 s into a fresh clone's ``make test`` (in ``pip install -e ".[dev]"``) left mypy's
metadata in ``.venv`` without ``.venv/bin/mypy``; pip called mypy installed from then on, and
every later ``make test`` of that clone failed in a second (an interrupt round of
``scripts/interrupt-make-test.py`` found it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import processes

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "venv-ready.sh"


#: an interpreter standing in for python3 (every ``make install`` runs the script with the real
#: one): ``-m venv DIR`` makes DIR with this script as its python and counts it in DIR/made,
#: ``-m pip`` succeeds
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin" "$3/lib/python3.11/site-packages" && cp "$0" "$3/bin/python"
    echo made >> "$3/made"
    exit 0
fi
[ "$1" = -m ] && [ "$2" = pip ]
"""


def _ready(venv: Path, python: Path) -> subprocess.CompletedProcess[str]:
    return processes.run([str(SCRIPT), str(venv), str(python)], timeout=60)


def _stopped_install(venv: Path) -> Path:
    """What a stopped ``pip install`` leaves: a package's metadata, no console script."""
    (site,) = (venv / "lib").glob("python3*/site-packages")
    left = site / "mypy-0.0.0.dist-info"
    left.mkdir()
    (left / "METADATA").write_text("Metadata-Version: 2.1\nName: mypy\nVersion: 0.0.0\n")
    return left


def test_a_venv_whose_install_was_stopped_is_made_again(tmp_path: Path) -> None:
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    venv = tmp_path / ".venv"
    first = _ready(venv, python)
    assert first.returncode == 0, first.stderr
    assert (venv / "bin" / "python").exists() and (venv / ".installing").exists()
    left = _stopped_install(venv)
    # the install was stopped: the mark is still there, and the venv is made again
    again = _ready(venv, python)
    assert again.returncode == 0, again.stderr
    assert "was stopped part-way" in again.stderr
    assert not left.exists() and (venv / "made").read_text() == "made\n"
    # an install that went through (the Makefile removed the mark) is kept as it is
    kept = _stopped_install(venv)
    (venv / ".installing").unlink()
    third = _ready(venv, python)
    assert third.returncode == 0, third.stderr
    assert kept.exists() and "stopped" not in third.stderr
    # a venv whose creation was stopped (a python, no pip) is made again too
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (venv / ".installing").unlink()
    fourth = _ready(venv, python)
    assert fourth.returncode == 0, fourth.stderr
    assert not kept.exists() and (venv / "made").read_text() == "made\n"


def test_the_makefile_marks_its_installs_done_only_after_the_last() -> None:
    """``make -n install``: the script first, the mark removed after the last pip install and
    before the stamps (a stop before that leaves the mark, and the next install starts over)."""
    # alone, as a user runs it: not as the sub-make of a make test, which names its folder
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "install"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("scripts/venv-ready.sh .venv"), lines[:3]
    last_pip = max(i for i, line in enumerate(lines) if "pip install" in line)
    done = lines.index("rm -f .venv/.installing")
    stamp = next(i for i, line in enumerate(lines) if line.startswith("touch .venv/.installed"))
    assert last_pip < done < stamp
