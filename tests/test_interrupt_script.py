"""``scripts/interrupt-make-test.py`` on clones whose ``make test`` is a few lines: it stops a
run part-way, lists what the run left behind, runs ``make test`` again and says whether that
passed. (Its real use, ten rounds of the whole suite, is in docs/PERFORMANCE.md.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "interrupt-make-test.py"

#: a make test that takes a second and a half and leaves a marker only while it runs
CLEAN = """test:
\ttouch running && sleep 1.5 && rm running
"""
#: a make test that leaves a lock when stopped and fails (fast) while the lock is there: the
#: defect the script is for
FRAGILE = """test:
\ttest ! -e lock
\ttouch lock && sleep 1.5 && rm lock
"""


def _run(clone: Path, makefile: str, *args: str) -> tuple[int, list[dict[str, object]], str]:
    clone.mkdir()
    (clone / "Makefile").write_text(makefile)
    record = clone.parent / "record.jsonl"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--clone", str(clone), "--record", str(record), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    return done.returncode, rows, done.stdout


def test_a_stopped_run_that_does_not_harm_the_next_passes_every_round(tmp_path: Path) -> None:
    code, rows, out = _run(
        tmp_path / "clone", CLEAN, "--rounds", "3", "--max-delay", "1.2", "--seed", "1"
    )
    assert code == 0, out
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["passed"] and r["next_exit"] == 0 for r in rows)
    assert {r["signal"] for r in rows} <= {"INT", "TERM", "KILL"}
    assert "3 of 3 next runs passed" in out


def test_a_stop_that_breaks_the_next_run_fails_the_script(tmp_path: Path) -> None:
    code, rows, out = _run(
        tmp_path / "clone", FRAGILE, "--rounds", "1", "--max-delay", "1.0", "--signals", "KILL"
    )
    assert code == 1
    (row,) = rows
    assert row["signal"] == "KILL"
    assert row["passed"] is False and row["next_exit"] != 0
    assert "0 of 1 next runs passed" in out


def test_the_rounds_stop_at_the_first_next_run_that_failed(tmp_path: Path) -> None:
    """A clone a stop broke fails every round after it (each next run at once): the script
    stops there unless told to go on."""
    args = ("--rounds", "3", "--max-delay", "1.0", "--signals", "KILL")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()  # a record of its own each
    code, rows, out = _run(tmp_path / "a" / "clone", FRAGILE, *args)
    assert code == 1 and len(rows) == 1 and not rows[0]["passed"]
    assert "stopped after round 1: its next run failed" in out and "0 of 3" in out
    code, rows, out = _run(tmp_path / "b" / "clone", FRAGILE, *args, "--keep-going")
    assert code == 1 and len(rows) == 3 and "stopped" not in out


def test_a_left_behind_process_is_listed(tmp_path: Path) -> None:
    """A process the stopped run started in its own session (as a daemon does) outlives the
    group's kill: the round names it."""
    orphan = """test:
\tsetsid sleep 30 >/dev/null 2>&1 < /dev/null & sleep 5
"""
    code, rows, _ = _run(
        tmp_path / "clone", orphan, "--rounds", "1", "--max-delay", "1.5", "--next-timeout", "1"
    )
    _kill_inside(tmp_path / "clone")
    (row,) = rows
    assert any("sleep 30" in p for p in row["left_behind"])  # type: ignore[attr-defined]
    assert row["next_exit"] == "timeout" and code == 1


def _kill_inside(clone: Path) -> None:
    """Kill the processes working in ``clone`` (the orphans the test made)."""
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if proc.name.isdigit() and os.readlink(proc / "cwd").startswith(str(clone)):
                os.kill(int(proc.name), signal.SIGKILL)


def test_what_a_signal_did_not_end_is_named_before_it_is_killed(tmp_path: Path) -> None:
    """A run that ignores Ctrl-C is SIGKILLed after the grace; the round names what lingered."""
    deaf = """test:
\tsh -c 'trap "" INT TERM; exec sleep 7' & sleep 5
"""
    _, rows, _ = _run(
        tmp_path / "clone",
        deaf,
        *("--rounds", "1", "--max-delay", "1.5", "--signals", "INT", "--grace", "1"),
        *("--next-timeout", "1"),
    )
    (row,) = rows
    assert row["signal"] == "INT"
    assert any("sleep 7" in p for p in row["lingering"])  # type: ignore[attr-defined]


def test_a_ctrl_c_reaches_the_run_when_the_script_was_started_with_it_ignored(
    tmp_path: Path,
) -> None:
    """Started in the background of a shell without job control, the script has SIGINT
    ignored; the run it stops must still hear the Ctrl-C (it ends at once, nothing lingers)."""
    makefile = """test:
\tsleep 20
"""
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "Makefile").write_text(makefile)
    record = tmp_path / "record.jsonl"
    argv = [sys.executable, str(SCRIPT), "--clone", str(clone), "--record", str(record)]
    argv += ["--rounds", "1", "--max-delay", "1.5", "--signals", "INT", "--grace", "10"]
    argv += ["--next-timeout", "1"]

    def deaf() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    subprocess.run(argv, capture_output=True, timeout=120, preexec_fn=deaf)
    (row,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert row["signal"] == "INT"
    assert row["lingering"] == [] and row["killed_exit"] != -signal.SIGKILL, row


def test_the_shell_that_started_the_script_in_the_clone_is_not_left_behind(tmp_path: Path) -> None:
    """A process the stopped run left is listed; the script's ancestors, whose folder may be the
    clone (``cd clone && script``), are not: this test's process stands for that shell."""
    clone = tmp_path / "clone"
    clone.mkdir()
    left = subprocess.Popen(["sleep", "60"], cwd=clone)  # what a stopped run might leave
    probe = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('interrupt', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(json.dumps(m._left_behind(__import__('pathlib').Path({str(clone)!r}))))\n"
    )
    before = Path.cwd()
    os.chdir(clone)  # the starting shell's folder is the clone
    try:
        proc = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
        )
    finally:
        os.chdir(before)
        left.kill()
        left.wait()
    assert proc.returncode == 0, proc.stderr
    listed = [line.split(":")[0] for line in json.loads(proc.stdout)]
    assert listed == [str(left.pid)], proc.stdout
