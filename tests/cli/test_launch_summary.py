"""``headroom launch`` ends with what a user came for: the plan it trained, the predicted peak
against the measured one (like with like: allocated bytes), throughput and the final loss, in
text and in ``--format json``; while it trains it shows each step (``headroom train
--progress``, followed by ``cli.progress``): on stderr in text, in ``progress`` in JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from headroom_process import run_headroom


def test_a_launch_ends_with_the_plan_the_peaks_the_throughput_and_the_loss(tmp_path: Path) -> None:
    env = {**os.environ, "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path / 'store.db'}"}
    # a 1,024-token sequence: a CPU trains it several times faster than the default 4,096
    args = ("launch", "tiny-dense", "--set", "seq_len=1024", "--steps", "2", "--device", "cpu")
    proc = run_headroom(*args, "--format", "json", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    summary = out["summary"]
    assert out["run"]["status"] == "succeeded" and summary["completed_steps"] == 2
    assert summary["plan"]["micro_batch_size"] >= 1 and summary["plan"]["parallel"]["dp"] == 1
    assert 0 < summary["predicted_allocated_peak_bytes"] < summary["predicted_gpu_peak_bytes"]
    assert summary["measured_on"] == "simulated device" and summary["measured_gpu_peak_bytes"] > 0
    # priced by the bundled trainer's own profile, it is its measured peak within 1 % (the
    # default profile, the textbook's, was 22 % under it)
    assert summary["plan"]["activation_profile"] == "runtime"
    predicted, measured = (
        summary["predicted_allocated_peak_bytes"],
        summary["measured_gpu_peak_bytes"],
    )
    assert abs(predicted - measured) <= 0.01 * measured
    assert summary["tokens_per_second"] > 0 and summary["final_loss"] > 0
    # every step as the trainer ended it: the last one's loss is the summary's
    steps = out["progress"]
    assert [s["step"] for s in steps] == [1, 2] and {s["steps"] for s in steps} == {2}
    assert steps[-1]["loss"] == summary["final_loss"]
    assert steps[0]["tokens_per_s"] is None and steps[1]["tokens_per_s"] > 0
    assert steps[1]["tokens"] == 2 * steps[0]["tokens"] and steps[1]["seconds"] > 0
    text = run_headroom(*args, env=env, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    # not a terminal: plain lines on stderr, the first step's and the last one's
    shown = [line for line in text.stderr.splitlines() if line.startswith("step ")]
    assert shown[0].startswith("step 1/2, loss ") and shown[-1].startswith("step 2/2, loss ")
    assert "tokens/s" in shown[-1]
    lines = text.stdout.splitlines()
    assert lines[1].startswith("plan: micro-batch ")
    assert lines[2].startswith("allocated peak predicted ") and "measured " in lines[2]
    assert "runtime profile" in lines[2]
    assert lines[3].startswith("2 step(s), ") and "tokens/s, final loss " in lines[3]


def test_a_profile_the_spec_names_is_the_one_a_launch_prices(tmp_path: Path) -> None:
    env = {**os.environ, "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path / 'store.db'}"}
    args = ("launch", "tiny-dense", "--set", "seq_len=1024", "--steps", "1", "--device", "cpu")
    args += ("--format", "json")
    proc = run_headroom(*args, "--set", "activation_profile=textbook", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert summary["plan"]["activation_profile"] == "textbook"
    # what the textbook prices is not what this trainer saves
    assert summary["predicted_allocated_peak_bytes"] < 0.9 * summary["measured_gpu_peak_bytes"]
