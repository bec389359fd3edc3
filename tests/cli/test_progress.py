"""A launch follows its trainer's ``progress.jsonl`` as it is written (``cli.progress``): a line
half written waits for its end, a file that is not there yet is waited for, and what is shown
is a bar in a terminal, plain lines elsewhere (throttled, the last step always), nothing with
``--format json``; ``headroom train --progress`` writes the steps the report's losses are."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

from headroom_process import run_headroom

from headroom.cli.progress import Follower, step_text


def _line(step: int, steps: int = 4, rate: float | None = 100.0) -> bytes:
    body = {"step": step, "steps": steps, "loss": 6.5 - step / 10, "seconds": step * 0.5}
    body |= {"tokens": 64 * step, "tokens_per_s": rate}
    return (json.dumps(body) + "\n").encode()


def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not seen in time"
        time.sleep(0.02)


def test_lines_are_read_as_they_land_and_a_half_line_waits(tmp_path: Path) -> None:
    path, out = tmp_path / "progress.jsonl", io.StringIO()
    with Follower(path, "lines", stream=out, poll_s=0.02, every_s=3600) as follower:
        time.sleep(0.1)  # no file yet: nothing, and no error
        with path.open("ab") as f:
            f.write(_line(1, rate=None))
            f.write(_line(2)[:20])  # the trainer is mid-write
            f.flush()
            _until(lambda: len(follower.lines) == 1)
            time.sleep(0.1)
            assert len(follower.lines) == 1  # the half line is not read as a step
            f.write(_line(2)[20:] + _line(3) + b"not json\n" + _line(4))
            f.flush()
            _until(lambda: len(follower.lines) == 4)
    assert [line["step"] for line in follower.lines] == [1, 2, 3, 4]
    # throttled: the first step shown at once, then none for an hour, but the last at the end
    shown = out.getvalue().splitlines()
    assert shown == [step_text(follower.lines[0]), step_text(follower.lines[-1])]
    assert shown[0] == "step 1/4, loss 6.4000, tokens/s from step 2, 0.5 s"
    assert shown[1] == "step 4/4, loss 6.1000, 100 tokens/s, 2.0 s"


def test_json_shows_nothing_and_a_bar_ends_on_the_last_step(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    path.write_bytes(b"".join(_line(s) for s in (1, 2, 3, 4)))
    quiet = io.StringIO()
    with Follower(path, "none", stream=quiet) as follower:
        pass
    assert quiet.getvalue() == "" and len(follower.lines) == 4
    bar = io.StringIO()
    with Follower(path, "bar", stream=bar, poll_s=0.02):
        pass
    assert "4/4" in bar.getvalue() and "loss 6.1000" in bar.getvalue()


def test_train_progress_writes_the_reports_losses_step_by_step(tmp_path: Path) -> None:
    progress, report = tmp_path / "progress.jsonl", tmp_path / "report.json"
    progress.write_text('{"step": 9}\n')  # an earlier run's: replaced, not appended to
    sets = ("--set", "seq_len=32", "--set", "grad_accum_steps=2")
    proc = run_headroom(
        *("train", "tiny-dense", "--steps", "3", *sets),
        *("--progress", str(progress), "--report", str(report)),
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in progress.read_text().splitlines()]
    losses = json.loads(report.read_text())["losses"]
    assert [line["loss"] for line in lines] == losses and len(losses) == 3
    assert [line["tokens"] for line in lines] == [64, 128, 192]  # 2 micro-batches of 32 tokens
    assert all(line["steps"] == 3 for line in lines)
    assert lines[0]["seconds"] < lines[1]["seconds"] < lines[2]["seconds"]


def test_a_progress_file_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path,
) -> None:
    proc = run_headroom("train", "tiny-dense", "--progress", str(tmp_path / "no" / "p.jsonl"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --progress: cannot write ")
