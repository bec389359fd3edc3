"""``headroom launch`` follows its run: the trainer appends one JSON line per optimizer step to
its run directory's ``progress.jsonl`` (``headroom train --progress``), and a thread here reads
each line as it lands while the launch waits for the run to end.

In a terminal the lines drive a rich progress bar on stderr (step of steps, loss, tokens/s);
elsewhere (a CI log, a pipe) one plain line to stderr at most every ``every_s`` seconds, and
the last step's; with ``--format json`` nothing is shown while the run goes and every line is
in the output's ``progress``. No torch here: the launch process only reads a file.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO


def step_text(line: dict[str, Any]) -> str:
    """One step as a line of text: ``step 12/20, loss 6.2446, 1,259 tokens/s, 9.3 s``."""
    rate = line.get("tokens_per_s")
    parts = [
        f"step {line['step']}/{line['steps']}",
        f"loss {line['loss']:.4f}",
        f"{rate:,.0f} tokens/s" if rate is not None else "tokens/s from step 2",
        f"{line['seconds']:.1f} s",
    ]
    return ", ".join(parts)


class Follower:
    """Reads ``path`` (which may not exist yet) from a thread until :meth:`stop`; ``show``:
    ``"bar"``, ``"lines"`` or ``"none"``. ``lines`` holds every step read, in order."""

    def __init__(
        self,
        path: Path,
        show: str,
        *,
        stream: TextIO | None = None,
        poll_s: float = 0.25,
        every_s: float = 5.0,
    ) -> None:
        self.path, self.show, self.poll_s, self.every_s = path, show, poll_s, every_s
        self.stream = stream or sys.stderr
        self.lines: list[dict[str, Any]] = []
        self._offset = 0
        self._pending = b""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="launch-progress", daemon=True)
        self._printed_at = float("-inf")
        self._printed_step = 0
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Follower:
        if self.show == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[detail]}"),
                console=Console(file=self.stream),
                transient=False,
            )
            self._bar.start()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        self._read()  # what landed after the last poll
        if self.show == "lines" and self.lines and self._printed_step != self.lines[-1]["step"]:
            self._print(self.lines[-1])
        if self._bar is not None:
            self._bar.stop()

    def _run(self) -> None:
        while not self._done.wait(self.poll_s):
            self._read()

    def _read(self) -> None:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self._offset:  # a new file (a run started over): from its start
                    self._offset, self._pending = 0, b""
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return  # not written yet
        self._offset += len(chunk)
        data = self._pending + chunk
        *complete, self._pending = data.split(b"\n")  # a line half written waits for its end
        for raw in complete:
            try:
                line = json.loads(raw)
                if isinstance(line, dict) and {"step", "steps", "loss", "seconds"} <= set(line):
                    self._show(line)
            except ValueError:
                continue  # not a step's line: the trainer writes nothing else here

    def _show(self, line: dict[str, Any]) -> None:
        self.lines.append(line)
        if self._bar is not None:
            if self._task is None:
                self._task = self._bar.add_task("train", total=line["steps"], detail="")
            detail = step_text(line).split(", ", 1)[1]
            self._bar.update(self._task, completed=line["step"], detail=detail)
        elif self.show == "lines" and time.monotonic() - self._printed_at >= self.every_s:
            self._print(line)

    def _print(self, line: dict[str, Any]) -> None:
        print(step_text(line), file=self.stream, flush=True)
        self._printed_at, self._printed_step = time.monotonic(), line["step"]
