"""The README runs as written: every command of every shell block is run (in a scratch folder
whose ``docs/`` and ``bench/`` are this checkout's, against a SQLite store of its own) and must
exit as the README implies (0, or the code a ``# exit N`` comment on its line names). A
command that cannot run on this machine (a GPU, a real cluster, the package index) is listed
in ``NOT_RUN`` with the reason and the test that covers it instead; a README command that is
neither run nor listed fails the test. The YAML block is a training spec and must validate; the
Python block runs as a script."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import processes
import pytest
import yaml

from headroom import planner

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)

#: commands not run here, by how they start: why, and what tests their substance instead
NOT_RUN = {
    "make run": "the quick start itself: tests/test_packaging.py checks what it installs",
    "make test": "the quick start itself: CI runs it",
    "pip install": "installs from the package index: tests/test_packaging.py installs the wheel",
    "python3 -m pip install": "a GPU host's install from the wheelhouse (bench/wheelhouse.py)",
    ".venv/bin/python bench/wheelhouse.py": "downloads wheels for another Python: "
    "tests/runtime/test_gpu_host.py checks its list",
    "python3 bench/runtime_gpu.py": "needs a GPU: tests/test_bench_scripts.py runs it on a CPU",
    "python3 bench/calibration_gpu.py": "needs a GPU: tests/test_bench_scripts.py runs it on a CPU",
    "headroom launch llama-3-8b --steps 100 --backend slurm": "needs the cluster's "
    "/etc/slurm/slurm.conf: tests/launch/test_slurm_runs.py launches on a one-node cluster",
    "curl -X POST localhost:8000/api/v1/runs": "needs a served API with Slurm: "
    "tests/api/test_launch.py posts runs",
    "kubectl apply": "needs a Kubernetes cluster: tests/launch/test_k8s_manifest.py validates "
    "the manifest against the PyTorchJob schema",
}


def _commands(script: str) -> list[str]:
    """The block's commands, continuation lines joined, comment-only lines left out."""
    out: list[str] = []
    pending = ""
    for line in script.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        out.append(pending.strip())
        pending = ""
    return out


def _blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README.read_text()) if lang == language]


def _shell_commands() -> list[str]:
    return [c for lang in ("sh", "bash") for block in _blocks(lang) for c in _commands(block)]


def _not_run(command: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.startswith(start)), None)


def _expected_exit(command: str) -> int:
    found = re.search(r"#\s*exit (\d+)", command)
    return int(found.group(1)) if found else 0


def test_every_readme_command_is_run_or_listed_with_its_reason() -> None:
    commands = _shell_commands()
    assert len(commands) >= 30, commands  # the README's blocks were found
    for start in NOT_RUN:  # no stale entry: each still names a README command
        assert any(c.startswith(start) for c in commands), start


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A folder whose docs/ and bench/ are this checkout's, and the environment the commands
    run in: ``headroom`` and ``.venv/bin/headroom`` are this interpreter's, the store is a
    SQLite file of its own."""
    work = tmp_path_factory.mktemp("readme")
    for name in ("docs", "bench"):
        (work / name).symlink_to(ROOT / name)
    bin_dir = work / "bin"
    bin_dir.mkdir()
    venv_bin = work / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    for folder in (bin_dir, venv_bin):
        script = folder / "headroom"
        script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m headroom "$@"\n')
        script.chmod(0o755)
    (venv_bin / "python").symlink_to(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HEADROOM_DATABASE_URL": f"sqlite:///{work / 'headroom.db'}",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
    }
    return work, env


@pytest.mark.timeout(900)
def test_every_runnable_readme_command_exits_as_the_readme_says(
    scratch: tuple[Path, dict[str, str]],
) -> None:
    work, env = scratch
    ran = 0
    for command in _shell_commands():
        if _not_run(command) is not None:
            continue
        if command.startswith("export "):
            for assignment in shlex.split(command)[1:]:
                key, _, value = assignment.partition("=")
                env[key] = os.path.expandvars(value)
            continue
        proc = processes.run(["bash", "-c", command], timeout=600, env=env, cwd=work)
        expected = _expected_exit(command)
        assert proc.returncode == expected, (command, proc.returncode, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (command, proc.stderr[-2000:])
        ran += 1
    assert ran >= 20, ran


def test_the_readmes_training_spec_block_is_a_valid_spec_and_the_shipped_example() -> None:
    (block,) = _blocks("yaml")
    spec = planner.load_train(yaml.safe_load(block))
    shipped = planner.load_train(yaml.safe_load((ROOT / "docs/examples/train.yaml").read_text()))
    assert spec == shipped


def test_the_readmes_python_blocks_run(tmp_path: Path) -> None:
    blocks = _blocks("python")
    assert len(blocks) >= 2  # "From Python" and the memory hook
    for i, block in enumerate(blocks):
        script = tmp_path / f"example{i}.py"
        script.write_text(block)
        proc = processes.run([sys.executable, str(script)], timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, f"block {i}:\n{block}\n{proc.stderr[-2000:]}"
