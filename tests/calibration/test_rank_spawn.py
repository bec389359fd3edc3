"""``calibration.processes``: ranks spawned with a deadline (``spawn``, which DeepSpeed's probe
runs its gloo ranks through) and processes bound to their parent (``die_with_parent``).

A rank that hangs must fail its caller with an error naming what timed out, not hang it; a
rank that fails stops the others; and however it ends, no rank is left running, not even when
the process that spawned them is SIGKILLed. The ranks here ignore SIGINT and SIGTERM, as a
rank stuck in a collective's C code does: only SIGKILL ends them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import processes as bound
import pytest
from torch.multiprocessing.spawn import ProcessRaisedException

from headroom.calibration import processes

HERE = Path(__file__).resolve().parent
#: long enough for two spawned ranks to import torch on a busy 2-core machine
DEADLINE_S = 10.0
GRACE_S = 1.0


def _deaf() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _hang(rank: int, pids: str) -> None:
    """A rank that never ends on its own: its pid in ``pids``, then it waits."""
    _deaf()
    Path(pids, str(rank)).write_text(str(os.getpid()))
    time.sleep(600)


def _rank_1_raises(rank: int, pids: str) -> None:
    _deaf()
    Path(pids, str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        raise ValueError("rank 1 broke")
    time.sleep(600)


def _finish(rank: int, out: str) -> None:
    Path(out, str(rank)).write_text("done")


def _pids(directory: Path) -> list[int]:
    return [int(p.read_text()) for p in directory.iterdir()]


def test_ranks_that_finish_return(tmp_path: Path) -> None:
    processes.spawn(_finish, (str(tmp_path),), 2, what="test ranks", timeout_s=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]
    assert multiprocessing.active_children() == []


def test_a_hanging_rank_times_out_naming_what_and_none_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No deadline passed, as DeepSpeed's probe passes none: the module's, read at the call."""
    monkeypatch.setattr(processes, "SPAWN_TIMEOUT_S", DEADLINE_S)
    began = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        processes.spawn(_hang, (str(tmp_path),), 2, what="hanging ranks", grace_s=GRACE_S)
    took = time.monotonic() - began
    assert str(raised.value) == (
        "hanging ranks: rank(s) 0, 1 of 2 still running after the 10 s deadline; stopped"
    )
    # the deadline, then one grace for SIGTERM (ignored) before SIGKILL
    assert DEADLINE_S <= took < DEADLINE_S + GRACE_S + 10, took
    assert multiprocessing.active_children() == []  # every rank reaped
    assert [p for p in _pids(tmp_path) if bound.running(p)] == []


def test_a_rank_that_raises_stops_the_others(tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 1 broke"):
        processes.spawn(
            _rank_1_raises, (str(tmp_path),), 2, what="test ranks", timeout_s=120, grace_s=GRACE_S
        )
    assert time.monotonic() - began < 60  # not the deadline: the failure ends the wait
    assert multiprocessing.active_children() == []
    assert [p for p in _pids(tmp_path) if bound.running(p)] == []


def test_ranks_die_with_a_sigkilled_parent(tmp_path: Path) -> None:
    """The spawning process is SIGKILLed (no cleanup runs in it): the kernel kills its ranks,
    which ignore the SIGINT torch's own parent-death setting would send."""
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]
        from test_rank_spawn import _hang
        from headroom.calibration import processes
        processes.spawn(_hang, ({str(tmp_path)!r},), 2, what="orphaned ranks")
    """)
    with bound.started([sys.executable, "-c", code]) as parent:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2:
            assert parent.poll() is None and time.monotonic() < deadline, "no ranks started"
            time.sleep(0.1)
        time.sleep(0.2)  # both pid files written in full
        ranks = _pids(tmp_path)
        assert all(bound.running(p) for p in ranks)
        parent.kill()
        parent.wait(timeout=10)
        assert bound.wait_gone(ranks, 5) == []


def test_a_child_bound_with_die_with_parent_dies_with_its_sigkilled_parent() -> None:
    code = textwrap.dedent("""
        import functools, os, subprocess, time
        from headroom.calibration.processes import die_with_parent
        child = subprocess.Popen(
            ["sleep", "600"], preexec_fn=functools.partial(die_with_parent, os.getpid())
        )
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    with bound.started([sys.executable, "-c", code], stdout=subprocess.PIPE) as parent:
        line = parent.stdout.readline() if parent.stdout is not None else b""
        child = int(line)
        assert bound.running(child)
        parent.kill()
        parent.wait(timeout=10)
        assert bound.wait_gone([child], 5) == []


def test_a_process_whose_parent_is_already_gone_kills_itself() -> None:
    """The parent died before the request was made: waiting for its death would wait forever."""
    code = (
        "from headroom.calibration.processes import die_with_parent; "
        "die_with_parent(parent=1); print('survived')"
    )
    done = bound.run([sys.executable, "-c", code], timeout=60)
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout
