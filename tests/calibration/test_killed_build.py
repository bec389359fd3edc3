"""A build of a framework's C++ op killed part-way never blocks the next one
(``calibration.frameworks.extensions``).

torch guards an op's build folder with a ``lock`` file that every other process waits on
forever; a build killed mid-way leaves it. These tests kill builds for real and hold that the
next load goes on: the lock a dead build left is cleared and the op built again, while a live
build is still waited for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from headroom.calibration.frameworks import extensions

ROOT = Path(__file__).resolve().parents[2]


def test_a_dead_builds_lock_is_cleared_and_the_op_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``lock`` left in an op's folder, with half its objects: the folder goes and the load
    runs on a clean one."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "some_op"
    folder.mkdir()
    (folder / "lock").touch()
    (folder / "half.o").write_bytes(b"\x7fELF")
    seen: list[list[str]] = []

    def load() -> str:
        seen.append(sorted(p.name for p in folder.glob("*")) if folder.exists() else [])
        return "module"

    assert extensions.load_op("some_op", load) == "module"
    assert seen == [[]]
    # nothing stale the second time: the folder a build made is kept
    folder.mkdir()
    (folder / "some_op.so").touch()
    assert extensions.load_op("some_op", load) == "module"
    assert seen[-1] == ["some_op.so"]


_HOLD = """
import sys, time
from pathlib import Path
from headroom.calibration.frameworks import extensions
with extensions.build_lock(Path(sys.argv[1])):
    Path(sys.argv[2]).touch()
    time.sleep(600)
"""


def _holder(root: Path, ready: Path) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(root), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert child.poll() is None, "the lock holder exited"
        assert time.monotonic() < deadline, "the lock holder never took the lock"
        time.sleep(0.05)
    return child


def test_a_live_build_is_waited_for_and_a_killed_ones_lock_is_free(tmp_path: Path) -> None:
    """While another process builds, a load waits (here bounded, and told so); once that
    process is killed, its lock is free at once."""
    holder = _holder(tmp_path, tmp_path / "ready")
    try:
        started = time.monotonic()
        with (
            pytest.raises(extensions.BuildLockTimeout, match=r"held .* for over 1 s"),
            extensions.build_lock(tmp_path, wait_s=1.0),
        ):
            pass
        assert time.monotonic() - started >= 1.0
    finally:
        holder.kill()
        holder.wait(timeout=30)
    started = time.monotonic()
    with extensions.build_lock(tmp_path, wait_s=5.0):
        assert time.monotonic() - started < 1.0


DEEPSPEED_TEST = (
    "tests/planner/test_deepspeed.py::test_the_buffers_deepspeed_makes_are_the_estimates"
)


def _pytest(cache: Path, *, ccache: bool = True) -> subprocess.Popen[str]:
    """The DeepSpeed test in a pytest of its own, its caches (the op's build) under
    ``cache``, in a session of its own so that the whole tree can be killed; without
    ``ccache`` its compiles are real ones (``CCACHE_DISABLE``: ``tests/compilers.py``)."""
    env = {**os.environ, "HEADROOM_TEST_CACHE": str(cache), "DS_ACCELERATOR": "cpu"}
    if not ccache:
        env["CCACHE_DISABLE"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{DEEPSPEED_TEST}[1]"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.timeout(900)
def test_the_deepspeed_test_killed_in_its_first_build_passes_the_next_time(
    tmp_path: Path,
) -> None:
    """The hang itself: the DeepSpeed test killed (SIGKILL to its whole process tree) while
    ninja builds its op leaves torch's ``lock``; the next run of the same test passes."""
    pytest.importorskip("deepspeed")
    lock = tmp_path / "torch_extensions" / "deepspeed_shm_comm" / "lock"
    # compiled for real, so that the kill lands mid-compile: from a warm ccache (an earlier
    # run of this clone's) the whole build takes under the 3 s below and leaves no lock
    first = _pytest(tmp_path, ccache=False)
    try:
        deadline = time.monotonic() + 300
        while not lock.exists():
            assert first.poll() is None, f"the first run ended before its build: {first.stdout}"
            assert time.monotonic() < deadline, "the first run never started its build"
            time.sleep(0.05)
        time.sleep(3.0)  # mid-compile
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate(timeout=60)
    assert lock.exists(), "the killed build left no lock: nothing was tested"
    second = _pytest(tmp_path)
    try:
        out, _ = second.communicate(timeout=600)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.communicate(timeout=60)
    assert second.returncode == 0, out
    assert "1 passed" in out
    assert not lock.exists()
    assert (lock.parent / "deepspeed_shm_comm.so").exists()
