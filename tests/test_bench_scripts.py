"""The bench scripts still run against today's code (their figures live in docs/PERFORMANCE.md;
nothing here is timed): each exits 0 on a tiny budget and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_estimate_bench_runs() -> None:
    out = _bench("bench/estimate.py", "--seconds", "0.02")
    assert "llama-3-8b default" in out and "deepseek-v3 pp16 dp64 ep64" in out


def test_the_ladder_bench_runs() -> None:
    out = _bench("bench/ladder.py", "--repeats", "1")
    assert "deepseek-v3 pp16 dp8 ep8" in out


def test_the_service_load_bench_migrates_serves_and_answers() -> None:
    out = _bench(
        "bench/api_load.py",
        "--client",
        "python",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--workers",
        "1",
    )
    assert "errors: non-200 0, socket 0" in out


def test_the_request_head_bench_runs() -> None:
    out = _bench("bench/request_head.py", "--requests", "200", "--batches", "1")
    assert "| HttpToolsProtocol |" in out and "| HeadLimitedProtocol |" in out


def test_the_service_cost_bench_runs_every_section() -> None:
    out = _bench(
        "bench/api_cost.py",
        *("--models", "20", "--at-once", "2", "--seconds", "0.3"),
        *("--threads", "2", "--mixed-seconds", "1"),
        *("--flood-held", "50", "--flood-seconds", "0.3", "--flood-head-timeout-s", "1"),
        *("--plan-repeats", "1", "--plan-dropped", "3"),
        # the figures mean nothing on a busy test machine: only that every section runs
        *("--max-rss-mib", "100000", "--worst-budget-s", "1000", "--health-budget-ms", "1e6"),
        *("--plan-budget-s", "1000"),
    )
    for section in ("memory:", "worst:", "junk:", "mixed:", "flood:", "plan:"):
        assert section in out, out
    assert "FAILED" not in out


def test_the_fsdp2_trace_bench_runs() -> None:
    out = _bench("bench/fsdp2_trace.py", "--layers", "1", "--world-sizes", "8")
    assert "1 layer(s) W=8    full" in out and "planner" in out
    out = _bench("bench/fsdp2_trace.py", "--records")
    assert "llama3-70b-2l" in out and "held out" in out


def test_the_hook_overhead_bench_runs() -> None:
    out = _bench("bench/hook_overhead.py", "--steps", "3", "--seq", "16")
    assert "in the hook" in out and "7 phase reads and one record written" in out
