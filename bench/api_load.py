"""Estimate requests per second over HTTP against a local, real server (target: >= 1,000 req/s
with p99 <= 10 ms on the development machine).

The script migrates a throwaway SQLite database once, starts ``uvicorn headroom.api.main:app`` on it
as a subprocess on a free local port (``--workers N``, ``HEADROOM_MIGRATE=false`` so the
workers do not race to migrate, uvloop and ``headroom serve``'s httptools protocol when
installed: with several workers the plain asyncio loop leaves Nagle on and every keep-alive
answer waits ~40 ms), checks that
every request body in the mix answers 200, warms the server up, then drives
``POST /api/v1/estimate`` for a fixed duration over keep-alive connections with a mix of
bodies (several models, training specs, GPUs and host sizes, so the run is not one cached
path) and prints the machine, the commands, req/s, p50/p90/p99 and the errors. It exits 1 if
any response was not a 200, a socket error happened or a server worker died, 2 if the server
could not start.

Load generators (they compete with the server for the same CPUs; say which one you used):

- ``wrk`` (default when on PATH; Debian: ``apt-get install -y wrk``): C, one event loop per
  thread, a Lua script rotates the bodies; latency percentiles come from its HdrHistogram.
- ``python``: an asyncio client on raw sockets (no HTTP library), one task per connection;
  it costs a lot more CPU per request than wrk, so on a small machine it lowers the numbers.

The load is closed-loop: each connection sends its next request when the previous answer
arrives, so at saturation latency ~= connections / throughput (queueing, not work). The default
of 4 connections (two per worker) keeps both workers busy without a queue; raise it to see how
latency grows once the server is saturated.

The script also reports CPU per request (server process tree and client, from /proc) and how
much CPU everything else on the machine used during the run: on a shared machine other
processes take CPU from both, and the req/s and tail latency drop with them.

Run: .venv/bin/python bench/api_load.py [--duration 10] [--connections 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PATH = "/api/v1/estimate"

#: the request mix: presets, training specs, GPUs and host sizes the service sees
BODIES: list[dict[str, Any]] = [
    {
        "model": "llama-3-8b",
        "train": {"micro_batch_size": 2},
        "gpu": "H200-141GB",
        "host_memory": "1TiB",
    },
    {
        "model": "llama-3-70b",
        "train": {"parallel": {"dp": 8, "tp": 8, "pp": 4, "zero_stage": 1}},
        "gpu": "H100-80GB",
    },
    {
        "model": "mixtral-8x7b",
        "train": {
            "parallel": {"dp": 8, "ep": 8, "zero_stage": 1},
            "recompute": "full",
            "offload": {"mode": "optimizer", "fraction": 0.5},
        },
        "gpu": "A100-80GB",
        "host_memory": "512GiB",
        "gpus_per_node": 8,
    },
    {
        "model": "deepseek-v3",
        "train": {"parallel": {"dp": 64, "pp": 16, "ep": 64, "zero_stage": 1}},
        "gpu": "H200-141GB",
    },
    {
        "model": "qwen2-7b",
        "train": {"micro_batch_size": 4, "seq_len": 8192, "recompute": "selective"},
        "gpu": "RTX-4090",
    },
    {
        "model": "llama-3-8b",
        "train": {"offload": {"mode": "streaming", "checkpoint_every": 4}},
        "gpu": "L40S",
        "host_memory": "256GiB",
    },
    {"model": "llama-3-70b", "gpu": "RTX-4090"},  # a predicted OOM: still a 200
    {"model": "mistral-7b", "train": {"micro_batch_size": 1, "seq_len": 2048}, "gpu": "GH200"},
]

LUA = """
local bodies = {%(bodies)s}
local n = #bodies
local i = 0
function setup(thread)
  thread:set("offset", i)
  i = i + 1
end
function init(args)
  i = offset or 0
end
function request()
  i = i + 1
  return wrk.format("POST", "%(path)s", {["Content-Type"] = "application/json"},
                    bodies[(i %% n) + 1])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write("WRK_JSON ")
  io.write(string.format(
    '{"requests": %%d, "duration_us": %%d, "bytes": %%d, "connect": %%d, "read": %%d, ' ..
    '"write": %%d, "status": %%d, "timeout": %%d, ' ..
    '"p50": %%d, "p90": %%d, "p99": %%d, "p999": %%d, "max": %%d, "mean": %%.1f}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max, latency.mean))
end
"""


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# --------------------------------------------------------------------------- machine + server


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    versions = []
    for dist in ("fastapi", "starlette", "pydantic", "uvicorn", "uvloop", "httptools"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
    return (
        f"{os.cpu_count()} CPUs ({cpu}){mem}; {platform.system()} {platform.release()}; "
        f"CPython {platform.python_version()}; " + ", ".join(versions)
    )


#: the HTTP protocol ``headroom serve`` runs (httptools with a bounded request head)
PROTOCOL = "headroom.api.protocol:HeadLimitedProtocol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        args.app,
        *(["--factory"] if args.factory else []),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(args.workers),
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    loop = args.loop
    if loop == "auto":
        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = args.http
    if http == "auto":  # what ``headroom serve`` runs: httptools with a bounded request head
        http = PROTOCOL if importlib.util.find_spec("httptools") else "h11"
    return [*cmd, "--loop", loop, "--http", http, "--backlog", "4096"]


MIGRATE = "import sys; from headroom.store import upgrade; upgrade(sys.argv[1])"


def post(url: str, body: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def wait_ready(base: str, proc: subprocess.Popen[bytes], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready after {seconds:.0f} s")


# ------------------------------------------------------------------------------ CPU accounting

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_tree(root: int) -> dict[int, float]:
    """``root`` and its live descendants (Linux /proc): pid -> CPU seconds, user + system,
    its own plus that of the children it has reaped (so a worker that died and was replaced
    during a run still counts)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
            times[int(entry.name)] = sum(int(f) for f in fields[11:15]) / TICK
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return {pid: times[pid] for pid in tree if pid in times}


def machine_cpu_seconds() -> tuple[float, float]:
    """CPU seconds since boot, all CPUs, from /proc/stat: (busy in this machine, stolen by the
    hypervisor for other guests)."""
    try:
        values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan"), float("nan")
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq) / TICK, steal / TICK


def children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------------- load: wrk


def run_wrk(args: argparse.Namespace, url: str, bodies: list[bytes], tmp: Path) -> dict[str, Any]:
    script = tmp / "estimate.lua"
    script.write_text(
        LUA % {"bodies": ", ".join(_lua_string(b.decode()) for b in bodies), "path": PATH}
    )
    cmd = [
        "wrk",
        f"--threads={args.threads}",
        f"--connections={args.connections}",
        f"--duration={args.duration}s",
        "--timeout=5s",
        f"--script={script}",
        url,
    ]
    print("load: " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip()}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("WRK_JSON "))
    raw = json.loads(line.removeprefix("WRK_JSON "))
    errors = raw["connect"] + raw["read"] + raw["write"] + raw["timeout"]
    return {
        "client": "wrk " + _wrk_version(),
        "requests": raw["requests"],
        "seconds": raw["duration_us"] / 1e6,
        # wrk counts any status outside 2xx/3xx; the pre-flight check pinned every body to 200
        "non_200": raw["status"],
        "socket_errors": errors,
        "p50_ms": raw["p50"] / 1000,
        "p90_ms": raw["p90"] / 1000,
        "p99_ms": raw["p99"] / 1000,
        "p999_ms": raw["p999"] / 1000,
        "max_ms": raw["max"] / 1000,
    }


def _wrk_version() -> str:
    out = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False)
    words = (out.stdout + out.stderr).split()
    return words[1] if len(words) > 1 else "?"


# ------------------------------------------------------------------------------ load: python


def _request(body: bytes, host: str) -> bytes:
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _connection(
    host: str,
    port: int,
    requests: list[bytes],
    offset: int,
    stop: float,
    measure_from: float,
    latencies: list[int],
    statuses: dict[int, int],
) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    errors, i, n = 0, offset, len(requests)
    clock = time.perf_counter_ns
    try:
        while time.monotonic() < stop:
            started = clock()
            writer.write(requests[i % n])
            i += 1
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
                    break
            await reader.readexactly(length)
            if time.monotonic() >= measure_from:
                latencies.append(clock() - started)
                statuses[status] = statuses.get(status, 0) + 1
    except (OSError, asyncio.IncompleteReadError, ValueError):
        errors += 1
    finally:
        writer.close()
    return errors


def run_python(args: argparse.Namespace, port: int, bodies: list[bytes]) -> dict[str, Any]:
    print(
        f"load: asyncio raw-socket client in this process, {args.connections} connections, "
        f"{args.duration} s",
        flush=True,
    )
    requests = [_request(b, f"127.0.0.1:{port}") for b in bodies]
    latencies: list[int] = []
    statuses: dict[int, int] = {}

    async def main() -> tuple[int, float]:
        start = time.monotonic()
        stop = start + args.duration
        tasks = [
            _connection("127.0.0.1", port, requests, k, stop, start, latencies, statuses)
            for k in range(args.connections)
        ]
        errors = sum(await asyncio.gather(*tasks))
        return errors, time.monotonic() - start

    loop_factory = None
    if importlib.util.find_spec("uvloop"):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        errors, seconds = runner.run(main())
    latencies.sort()

    def pct(p: float) -> float:
        if not latencies:
            return float("nan")
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] / 1e6

    return {
        "client": "python asyncio raw sockets" + (" (uvloop)" if loop_factory else ""),
        "requests": len(latencies),
        "seconds": seconds,
        "non_200": sum(c for s, c in statuses.items() if s != 200),
        "socket_errors": errors,
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "p999_ms": pct(99.9),
        "max_ms": latencies[-1] / 1e6 if latencies else float("nan"),
    }


# ------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds of measured load")
    parser.add_argument(
        "--connections",
        type=int,
        default=4,
        help="keep-alive connections, each with one request in flight (closed loop)",
    )
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of unmeasured load")
    parser.add_argument("--client", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument("--loop", default="auto", help="uvicorn --loop (auto: uvloop if found)")
    parser.add_argument("--http", default="auto", help="uvicorn --http (auto: headroom serve's)")
    parser.add_argument("--app", default="headroom.api.main:app", help="what uvicorn serves")
    parser.add_argument("--factory", action="store_true", help="--app is an app factory")
    parser.add_argument("--url", help="measure this running server instead of starting one")
    args = parser.parse_args()

    client = args.client
    if client == "auto":
        client = "wrk" if shutil.which("wrk") else "python"
    elif client == "wrk" and not shutil.which("wrk"):
        parser.error("wrk is not on PATH (Debian: apt-get install -y wrk)")

    bodies = [json.dumps(b, separators=(",", ":")).encode() for b in BODIES]
    restarted = False
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="headroom-bench-") as tmpdir:
        tmp = Path(tmpdir)
        proc: subprocess.Popen[bytes] | None = None
        if args.url:
            base = args.url.rstrip("/")
            print(f"server: {base} (already running)")
        else:
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            cmd = server_command(args, port)
            url = f"sqlite:///{tmp / 'bench.db'}"
            env = {**os.environ, "HEADROOM_DATABASE_URL": url, "HEADROOM_MIGRATE": "false"}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            # Migrate once, then start the workers without migrating: every worker migrating
            # the same fresh database on start races (one fails, and uvicorn stops).
            subprocess.run(
                [sys.executable, "-c", MIGRATE, url], cwd=ROOT, env=env, check=True, timeout=120
            )
            print(
                "server: HEADROOM_DATABASE_URL=sqlite:///<tmp>/bench.db HEADROOM_MIGRATE=false "
                + " ".join(cmd)
            )
            with (tmp / "server.log").open("wb") as log:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                )
        try:
            if proc is not None:
                try:
                    wait_ready(base, proc)
                except RuntimeError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 2
            # pre-flight: every body in the mix must answer 200 with a budget
            for raw in bodies:
                status, payload = post(base + PATH, raw)
                if status != 200 or "fits" not in json.loads(payload):
                    print(f"error: {raw.decode()} -> {status} {payload[:300]!r}", file=sys.stderr)
                    return 1
            size = sum(len(post(base + PATH, raw)[1]) for raw in bodies) / len(bodies)
            print(f"bodies: {len(bodies)} in rotation, responses {size / 1024:.1f} KiB on average")

            warm = argparse.Namespace(**{**vars(args), "duration": max(1, round(args.warmup))})
            if args.warmup > 0:
                print(f"warm-up: {warm.duration} s (not measured)", flush=True)
                if client == "wrk":
                    run_wrk(warm, base, bodies, tmp)
                else:
                    run_python(warm, int(base.rsplit(":", 1)[1]), bodies)
            tree = process_tree(proc.pid) if proc is not None else {}
            server_cpu = sum(tree.values()) if tree else float("nan")
            client_cpu = children_cpu_seconds() + time.process_time()
            busy, steal = machine_cpu_seconds()
            if client == "wrk":
                result = run_wrk(args, base, bodies, tmp)
            else:
                result = run_python(args, int(base.rsplit(":", 1)[1]), bodies)
            busy_after, steal_after = machine_cpu_seconds()
            busy, steal = busy_after - busy, steal_after - steal
            client_cpu = children_cpu_seconds() + time.process_time() - client_cpu
            if proc is not None:
                after = process_tree(proc.pid)
                server_cpu = sum(after.values()) - server_cpu
                if proc.poll() is not None or set(after) != set(tree):
                    print(
                        "error: the server's processes changed during the run (a worker "
                        "died, or the server stopped); the numbers are not trustworthy",
                        file=sys.stderr,
                    )
                    restarted = True
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                # --log-level warning: anything here is worth seeing (worker deaths, errors)
                server_log = (tmp / "server.log").read_text(errors="replace").strip()
                if server_log:
                    print("server log:\n" + server_log[-3000:], file=sys.stderr)

    rps = result["requests"] / result["seconds"]
    print(f"client: {result['client']}")
    print(
        f"requests: {result['requests']} in {result['seconds']:.2f} s -> {rps:,.0f} req/s "
        f"({args.connections} connections, {args.workers} workers)"
    )
    print(
        f"latency ms: p50 {result['p50_ms']:.2f}  p90 {result['p90_ms']:.2f}  "
        f"p99 {result['p99_ms']:.2f}  p99.9 {result['p999_ms']:.2f}  max {result['max_ms']:.2f}"
    )
    n, secs = max(result["requests"], 1), result["seconds"]
    ncpu = os.cpu_count() or 1
    other = busy - server_cpu - client_cpu
    print(
        f"cpu per request: server {server_cpu / n * 1e6:.0f} µs, client {client_cpu / n * 1e6:.0f}"
        f" µs; during the run (of {ncpu} CPUs) the server used {server_cpu / secs:.2f}, the "
        f"client {client_cpu / secs:.2f}, other processes {max(other, 0) / secs:.2f}, and the "
        f"hypervisor stole {steal / secs:.2f} (steal time)"
    )
    if server_cpu == server_cpu:  # not NaN: we started the server
        bound = ncpu / ((server_cpu + client_cpu) / n)
        print(
            f"cpu-bound ceiling on this machine if nothing else ran: ~{bound:,.0f} req/s "
            f"({ncpu} CPUs / (server + client CPU per request))"
        )
    print(f"errors: non-200 {result['non_200']}, socket {result['socket_errors']}")
    met = rps >= 1000 and result["p99_ms"] <= 10
    print(f"target (>= 1,000 req/s, p99 <= 10 ms): {'met' if met else 'NOT met'}")
    return 1 if result["non_200"] or result["socket_errors"] or restarted else 0


if __name__ == "__main__":
    sys.exit(main())
