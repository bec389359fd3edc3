"""The GPU path needs only PyTorch's side of an environment plus the wheelhouse.

A GPU host with CUDA PyTorch and no network gets the rest from ``bench/wheelhouse.py``. These
tests run the GPU path's code on the CPU (the benches' imports, a probed ``headroom train`` and
the record the GPU matrix stores) under ``python -X importtime`` and check that every module
it imported comes from the standard library, this project, PyTorch's distributions or the
wheelhouse list.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
try:
    import wheelhouse
finally:
    sys.path.pop(0)

_RECORD = """
import sys
sys.path.insert(0, "bench")
import runtime_gpu
from calibration_gpu import probe_on_gpu
model = {"name": "gpu-host-check", "vocab_size": 256, "hidden_size": 64, "num_layers": 2,
         "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128}
train = {"micro_batch_size": 1, "seq_len": 32, "activation_profile": "runtime"}
outcome = probe_on_gpu(model, train, "H200-141GB", 2, device="cpu")
assert outcome["ok"], outcome["message"]
import os, sqlalchemy
engine = sqlalchemy.create_engine(os.environ["HEADROOM_DATABASE_URL"])
with engine.connect() as conn:
    sql = "select count(*) from calibrations where source = 'runtime'"
    assert conn.execute(sqlalchemy.text(sql)).scalar() == 1, "no record stored"
"""


def _imported(argv: list[str], env: dict[str, str]) -> set[str]:
    """Top-level names of the modules a command imported, less those PyTorch's side imported
    for itself (``torch.hub`` tries tqdm, sympy brings mpmath): only what the path asks for."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    owners = importlib.metadata.packages_distributions()
    torch_side = wheelhouse.torch_side()

    def by_torch(name: str) -> bool:
        return any(wheelhouse.normalise(d) in torch_side for d in owners.get(name, []))

    # importtime prints a module after its imports; reversed, each follows its importer
    rows = [
        line.rsplit("|", 1)[1]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]
    tops: set[str] = set()
    ancestors: list[tuple[int, str]] = []
    for field in reversed(rows):
        name = field.strip()
        if name == "imported package":  # the header
            continue
        depth = len(field) - len(field.lstrip())
        while ancestors and ancestors[-1][0] >= depth:
            ancestors.pop()
        top = name.split(".")[0]
        if not any(by_torch(a) for _, a in ancestors):
            tops.add(top)
        ancestors.append((depth, top))
    return tops


def _distributions(modules: set[str]) -> set[str]:
    owners = importlib.metadata.packages_distributions()
    return {wheelhouse.normalise(d) for m in modules for d in owners.get(m, [])}


def test_the_gpu_path_imports_nothing_beyond_torch_and_the_wheelhouse(tmp_path: Path) -> None:
    env = {**os.environ, "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path / 'store.db'}"}
    modules = _imported(["-c", _RECORD], env)
    modules |= _imported(
        [
            "-m",
            "headroom",
            "train",
            "tiny-dense",
            "--set",
            "seq_len=256",  # what it imports, not what it computes, matters here
            "--steps",
            "2",
            "--device",
            "cpu",
            "--report",
            str(tmp_path / "report.json"),
        ],
        env,
    )
    assert {"torch", "sqlalchemy", "alembic", "pydantic", "typer"} <= modules  # it ran the path
    allowed = {wheelhouse.normalise(n) for n in wheelhouse.GPU_PATH}
    allowed |= wheelhouse.torch_side() | {wheelhouse.normalise("headroom-planner")}
    extra = _distributions(modules) - allowed
    assert not extra, f"the GPU path imports {sorted(extra)}: add them to bench/wheelhouse.py"


def test_the_wheelhouse_pins_what_is_installed_for_the_hosts_python(tmp_path: Path) -> None:
    pins = wheelhouse.pins()
    assert len(pins) == len(wheelhouse.GPU_PATH)
    assert all("==" in p for p in pins)
    version = importlib.metadata.version("pydantic-core")
    assert f"pydantic-core=={version}" in pins  # pydantic's exact core pin travels with it
    argv = wheelhouse.download_argv("3.12", tmp_path)
    assert argv[argv.index("--python-version") + 1] == "3.12"
    assert "--no-deps" in argv and "--only-binary=:all:" in argv
    assert argv[-len(pins) :] == pins
