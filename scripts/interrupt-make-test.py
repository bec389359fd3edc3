#!/usr/bin/env python3
"""Kill ``make test`` at random points, again and again, and hold that the next ``make test``
passes each time.

Users and CI machines get stopped mid-run: Ctrl-C at a time limit (SIGINT to the foreground
process group), a job's end (SIGTERM), a machine's watchdog (SIGKILL). A suite that turns one
such stop into a hang or a failure of every later run costs a whole CI slot. Each round here:

1. starts ``make test`` in the clone, in a process group of its own;
2. after a random delay (up to ``--max-delay``, about the suite's length, so the stop falls
   anywhere: in ``make install``, the apt installs, a build, a gloo run, the Slurm tests, the
   browser) sends the group a random one of SIGINT, SIGTERM or SIGKILL, and SIGKILL a minute
   (``--grace``) later if anything is still there, naming what was (``lingering``: a Ctrl-C
   that does not stop the suite is a defect too, though not the one this script holds);
3. lists the processes the stopped run left behind (their command lines name the clone);
4. runs ``make test`` again, bounded by ``--next-timeout``: it must exit 0.

Usage (by default on a fresh clone of this repository in a temporary folder; the clone's
``.venv`` is kept across rounds, as on a machine that runs the suite again)::

    scripts/interrupt-make-test.py --rounds 10
    scripts/interrupt-make-test.py --rounds 3 --clone /tmp/h --max-delay 300 --seed 7

Each round's stop, what was running then, the leftovers and the next run's result and time
go to stdout and, as JSON lines, to ``--record``. Exit 0 when every next run passed.
Only the standard library: it runs before the clone has a virtualenv.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return " | ".join(line.strip()[-160:] for line in text[-lines:])


def _ancestors() -> set[int]:
    """This script and the processes that started it (a shell whose folder is the clone is the
    one that ran the script, not something a stopped run left)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the name is the state
    return pids


def _left_behind(clone: Path) -> list[str]:
    """Live processes, other than this script and its ancestors, whose command line or working
    folder is inside ``clone``."""
    found = []
    ours = _ancestors()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in ours:
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if str(clone) in cmd or cwd.startswith(str(clone)):
            found.append(f"{proc.name}: {cmd.strip()[:160]}")
    return found


def _group(pgid: int) -> list[str]:
    """Live members of process group ``pgid``: pid and command line."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{proc.name}: {cmd.strip()[:160]}")
    return found


def _stop_group(
    child: subprocess.Popen[bytes], sig: signal.Signals, grace_s: float = 60.0
) -> list[str]:
    """Send ``sig`` to ``child``'s process group and wait up to ``grace_s`` for the whole group
    to end; SIGKILL whatever is left. What was left then (empty: the signal ended it in time)."""
    try:
        os.killpg(child.pid, sig)
    except ProcessLookupError:
        return []
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        child.poll()
        if child.returncode is not None and not _group(child.pid):
            return []
        time.sleep(0.2)
    lingering = _group(child.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    return lingering


def _hear_ctrl_c() -> None:
    """Let ``make test`` hear SIGINT and SIGQUIT as from a terminal. A command started in the
    background of a shell without job control (``script &``, nohup, many CI steps) has both
    ignored, and an ignored signal stays ignored across exec: the suite would never hear the
    Ctrl-C this script sends, and every SIGINT round would end in the grace's SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _make_test(clone: Path, out: IO[bytes]) -> subprocess.Popen[bytes]:
    """``make test`` in ``clone``, its output to ``out``, in a process group of its own."""
    return subprocess.Popen(
        ["make", "test"],
        cwd=clone,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_hear_ctrl_c,
    )


def _round(
    clone: Path, number: int, rng: random.Random, args: argparse.Namespace
) -> dict[str, object]:
    logs = clone / "test-artifacts" / "interrupt"
    logs.mkdir(parents=True, exist_ok=True)
    killed_log = logs / f"round-{number}-killed.log"
    name = rng.choice(args.signals)
    delay = rng.uniform(1.0, args.max_delay)
    lingering: list[str] = []
    with killed_log.open("wb") as out:
        child = _make_test(clone, out)
        try:
            child.wait(timeout=delay)
            stopped = False
        except subprocess.TimeoutExpired:
            stopped = True
            running = _tail(killed_log)
            lingering = _stop_group(child, SIGNALS[name], args.grace)
    entry: dict[str, object] = {
        "round": number,
        "signal": name if stopped else None,
        "after_s": round(delay, 1),
        "running": running if stopped else "(ended by itself first)",
        "killed_exit": child.returncode,
        # what the signal had not ended a minute later (then SIGKILLed)
        "lingering": lingering,
    }
    time.sleep(2.0)
    entry["left_behind"] = _left_behind(clone)
    next_log = logs / f"round-{number}-next.log"
    started = time.monotonic()
    with next_log.open("wb") as out:
        nxt = _make_test(clone, out)
        try:
            nxt.wait(timeout=args.next_timeout)
        except subprocess.TimeoutExpired:
            _stop_group(nxt, signal.SIGKILL)
            entry["next_exit"] = "timeout"
        else:
            entry["next_exit"] = nxt.returncode
    entry["next_s"] = round(time.monotonic() - started, 1)
    entry["next_tail"] = _tail(next_log, 2)
    entry["passed"] = entry["next_exit"] == 0
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clone", type=Path, help="run in this clone (made if missing)")
    parser.add_argument("--max-delay", type=float, default=720.0, help="latest stop, seconds")
    parser.add_argument(
        "--grace", type=float, default=60.0, help="seconds a stopped run has to end by itself"
    )
    parser.add_argument("--next-timeout", type=float, default=2700.0, help="seconds")
    parser.add_argument("--signals", type=lambda s: s.split(","), default=list(SIGNALS))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--record", type=Path, default=None, help="JSON lines, one a round")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="go on after a round whose next run failed (default: stop there; the clone it "
        "left would only fail the rounds after it)",
    )
    args = parser.parse_args()
    for name in args.signals:
        if name not in SIGNALS:
            parser.error(f"--signals: unknown {name!r}; allowed: {', '.join(SIGNALS)}")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    source = Path(__file__).resolve().parents[1]
    clone = args.clone or Path(tempfile.mkdtemp(prefix="headroom-interrupt-")) / "headroom"
    if not (clone / "Makefile").exists():
        subprocess.run(["git", "clone", "-q", str(source), str(clone)], check=True)
    # the commit each round ran (none when the clone is not a git checkout)
    commit = (
        subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=False
        ).stdout.strip()
        or None
    )
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    print(f"clone {clone}, seed {seed}, {args.rounds} rounds", flush=True)
    passed = 0
    for number in range(1, args.rounds + 1):
        entry = _round(clone, number, rng, args)
        entry["seed"] = seed
        entry["commit"] = commit
        passed += bool(entry["passed"])
        print(json.dumps(entry), flush=True)
        if args.record:
            with args.record.open("a") as out:
                out.write(json.dumps(entry) + "\n")
        if not entry["passed"] and not args.keep_going and number < args.rounds:
            print(f"stopped after round {number}: its next run failed", flush=True)
            break
    print(f"{passed} of {args.rounds} next runs passed", flush=True)
    return 0 if passed == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
