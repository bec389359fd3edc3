"""What a request may cost the service, against a real server (uvicorn in a subprocess).

Sections (``--only memory,worst,junk,mixed,flood,plan``; all by default):

- ``memory``: N distinct 4,096-layer MoE models (each with 256 layers forced dense at random,
  the heaviest the schema allows) posted to ``/estimate`` by a few client threads; the server
  process's resident memory (``VmRSS``) before, while and after.
- ``worst``: the heaviest ``/fit`` the schema allows (a 4,096-layer, 256-expert MoE with 256
  layers forced dense at random, micro-batch 1,024, dp 8), alone and K at once, while
  ``/healthz`` and ``/readyz`` are polled every 20 ms: each fit's time and the health checks'
  largest latency. The issue's body (the same model without the dense layers) is timed too.
- ``junk``: ``/estimate`` requests per second from one client, alone and beside 4 clients
  posting bodies of 50,000 unknown keys (and the server CPU each of those costs).
- ``mixed``: T threads posting ``/fit``, ``/gate`` and ``/estimate`` in turn (presets and custom
  models) for D seconds: the statuses, which must all be 200.
- ``flood``: N connections that each send half a request head and stall, against ``headroom
  serve`` (its own server: that protocol's deadlines and connection cap, an open-file limit of
  ``--flood-nofile``); a preset ``/estimate``'s latency before, meanwhile (on a keep-alive
  connection opened before the flood and on a new connection per request) and after, how many
  connections the server refused as they opened and how long it held the others. The
  keep-alive client and everyone after the flood must get 200s, and the server must close
  every held connection within ``--flood-wait-s``.
- ``plan``: the worst ``/plan`` we know of (the report's body: every size highly divisible) and
  the longest plan of a bundled model (GPT-3 175B on 1,024 A100s), each posted
  ``--plan-repeats`` times: its status, time, the server's CPU and the growth of its peak
  resident memory (``VmHWM``). Then ``--plan-dropped`` of the long plans at once, whose clients
  close 0.2 s later, and a small ``/fit``'s latency after them; the searches' outcomes
  as ``/metrics`` counts them. The worst plan must be refused (422) within
  ``--plan-budget-s`` of server CPU, the long one answered (200).

The server runs with one worker on a throwaway SQLite database (migrated first), from this
checkout or from ``--root`` (another checkout, to measure before and after a change). The
script prints the machine, the server's command and each section's figures, and exits 1 when a
check fails: a 5xx or a transport error, the memory over ``--max-rss-mib``, a worst fit over
``--worst-budget-s`` or a health check over ``--health-budget-ms``.

Run: .venv/bin/python bench/api_cost.py [--models 1000] [--only memory,worst]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import api_load  # machine, free_port, MIGRATE, process CPU from /proc

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("memory", "worst", "junk", "mixed", "flood", "plan")


# ------------------------------------------------------------------------------------- bodies


def deep_model(i: int, dense_layers: int = 256, source: str | None = None) -> dict[str, Any]:
    """A distinct 4,096-layer MoE model; ``dense_layers`` of its layers forced dense at random
    (each breaks the layer pattern: the schema allows 256); ``source``, its free text."""
    moe: dict[str, Any] = {"num_experts": 256, "top_k": 8, "expert_ffn_size": 2048}
    if dense_layers:
        moe["dense_layers"] = sorted(random.Random(i).sample(range(4096), dense_layers))
    model = {
        "name": f"deep-{i}",
        "vocab_size": 32000 + i,
        "hidden_size": 4096,
        "num_layers": 4096,
        "num_heads": 32,
        "ffn_hidden_size": 11008,
        "moe": moe,
    }
    if source is not None:
        model["source"] = source
    return model


#: the heaviest search the schema allows that we know of: every dimension of the ladder at its
#: widest (11 micro-batches, 14 recompute policies, 14 placements, 4 ZeRO stages, both
#: allocator modes) over the least regular layers
WORST_FIT = {"model": deep_model(0), "train": {"micro_batch_size": 1024, "parallel": {"dp": 8}}}
#: the request of the report: the same search over regular layers (8 KB with its formatting)
ISSUE_FIT = {
    "model": deep_model(0, dense_layers=0),
    "train": {"micro_batch_size": 1024, "parallel": {"dp": 8}},
}
#: unknown keys in a junk body: the report's, and as many as fit the planning routes' limit
JUNK_KEYS = (50_000, 8_000)
PRESET_ESTIMATE = {"model": "llama-3-8b", "train": {"micro_batch_size": 2}, "gpu": "H100-80GB"}
SMALL_MODEL = {
    "name": "small",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "num_layers": 16,
    "num_heads": 16,
    "ffn_hidden_size": 4096,
}
#: the report's /plan (302 bytes as it was sent): every size highly divisible, 844,928 layouts
WORST_PLAN = json.loads((Path(__file__).parent / "bodies" / "worst-plan.json").read_text())
#: the longest plan of a bundled model the service makes (9,867 layouts)
LONG_PLAN = {
    "model": "gpt3-175b",
    "cluster": "DGX-A100",
    "gpus": 1024,
    "global_batch": 1536,
    "seq_len": 2048,
}
#: the mixed load's requests: (path, body)
MIXED = [
    ("/api/v1/estimate", PRESET_ESTIMATE),
    ("/api/v1/estimate", {"model": SMALL_MODEL, "train": {"micro_batch_size": 4}}),
    ("/api/v1/gate", {"model": "mixtral-8x7b", "train": {"parallel": {"dp": 8, "ep": 8}}}),
    ("/api/v1/gate", {"model": SMALL_MODEL, "margin_pct": 5}),
    ("/api/v1/fit", {"model": "tiny-moe", "train": {"micro_batch_size": 8}, "gpu": "RTX-4090"}),
    ("/api/v1/fit", {"model": SMALL_MODEL, "train": {"micro_batch_size": 64}}),
    ("/api/v1/estimate", {"model": deep_model(7, dense_layers=16)}),
]


# ------------------------------------------------------------------------------------- server


@dataclass
class Server:
    """``uvicorn headroom.api.main:app`` with one worker, on a throwaway SQLite database."""

    root: Path = ROOT
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    command: list[str] = field(default_factory=list)

    def __enter__(self) -> Server:
        self.tmp = tempfile.TemporaryDirectory(prefix="headroom-cost-")
        url = f"sqlite:///{self.tmp.name}/cost.db"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(self.root), *filter(None, [os.environ.get("COST_EXTRA_PATH")])]
            ),
            "HEADROOM_DATABASE_URL": url,
            "HEADROOM_MIGRATE": "false",
            "HEADROOM_RUN_DIR": f"{self.tmp.name}/runs",
        }
        migrate = [sys.executable, "-c", api_load.MIGRATE, url]
        subprocess.run(migrate, cwd=self.root, env=env, check=True)
        self.port = api_load.free_port()
        self.command = [
            sys.executable,
            "-m",
            "uvicorn",
            "headroom.api.main:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        log = open(Path(self.tmp.name) / "server.log", "wb")
        self.proc = subprocess.Popen(
            self.command, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        api_load.wait_ready(self.base, self.proc)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tmp is not None:
            self.tmp.cleanup()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_mib(self) -> float:
        """The server process's resident memory (Linux ``/proc``)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def peak_rss_mib(self) -> float:
        """The server process's peak resident memory so far (Linux ``/proc``: ``VmHWM``)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM")

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return sum(api_load.process_tree(self.proc.pid).values())

    def log(self) -> str:
        assert self.tmp is not None
        return (Path(self.tmp.name) / "server.log").read_text(errors="replace")


class Client:
    """One keep-alive connection (reopened after a transport error)."""

    def __init__(self, port: int, timeout: float = 120.0) -> None:
        self.port, self.timeout = port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """(status, body); status 0 for a transport error."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            self.conn.request(method, path, body=body, headers=headers)
            response = self.conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException):
            self.close()
            return 0, b""

    def post(self, path: str, body: Any) -> tuple[int, bytes]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.call("POST", path, raw)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _threads(count: int, work: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextlib.contextmanager
def health_poll(server: Server, every_s: float = 0.02) -> Iterator[dict[str, list[float]]]:
    """Poll ``/healthz`` and ``/readyz`` (one connection each) while the block runs:
    path -> latencies in ms (a failed check counts as infinity)."""
    seen: dict[str, list[float]] = {"/healthz": [], "/readyz": []}
    stop = threading.Event()

    def poll(path: str) -> None:
        client = Client(server.port, timeout=30)
        while not stop.is_set():
            start = time.perf_counter()
            status, _ = client.call("GET", path)
            took = (time.perf_counter() - start) * 1000
            seen[path].append(took if status == 200 else float("inf"))
            stop.wait(every_s)
        client.close()

    pollers = [threading.Thread(target=poll, args=(p,), daemon=True) for p in seen]
    for t in pollers:
        t.start()
    try:
        yield seen
    finally:
        stop.set()
        for t in pollers:
            t.join()


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else 0.0


def health_summary(seen: dict[str, list[float]]) -> dict[str, Any]:
    return {
        path.strip("/"): {
            "checks": len(ms),
            "p50_ms": round(_pct(ms, 50), 1),
            "p99_ms": round(_pct(ms, 99), 1),
            "max_ms": round(max(ms, default=0.0), 1),
        }
        for path, ms in seen.items()
    }


# ------------------------------------------------------------------------------------ sections


def memory(server: Server, models: int, clients: int = 3) -> dict[str, Any]:
    """Resident memory after ``models`` distinct 4,096-layer models posted to /estimate."""
    before = server.rss_mib()
    samples: list[tuple[int, float]] = [(0, before)]
    statuses: Counter[int] = Counter()
    done = [0]
    lock = threading.Lock()
    bodies = [
        json.dumps(
            {"model": deep_model(1000 + i), "train": {"micro_batch_size": 1 + i % 8}}
        ).encode()
        for i in range(models)
    ]
    start = time.perf_counter()

    def work(k: int) -> None:
        client = Client(server.port)
        for i in range(k, models, clients):
            status, _ = client.post("/api/v1/estimate", bodies[i])
            with lock:
                statuses[status] += 1
                done[0] += 1
                if done[0] % 100 == 0:
                    samples.append((done[0], server.rss_mib()))
        client.close()

    _threads(clients, work)
    seconds = time.perf_counter() - start
    after = server.rss_mib()
    return {
        "models": models,
        "statuses": dict(statuses),
        "seconds": round(seconds, 1),
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(max(r for _, r in [*samples, (models, after)]), 1),
        "rss_after_mib": round(after, 1),
        "rss_samples": [(n, round(r)) for n, r in samples],
    }


def _timed_fits(server: Server, body: Any, count: int) -> tuple[list[float], Counter[int]]:
    took: list[float] = [0.0] * count
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    raw = json.dumps(body).encode()

    def one(i: int) -> None:
        client = Client(server.port)
        start = time.perf_counter()
        status, _ = client.post("/api/v1/fit", raw)
        took[i] = time.perf_counter() - start
        with lock:
            statuses[status] += 1
        client.close()

    _threads(count, one)
    return took, statuses


def worst(server: Server, at_once: int = 4, repeats: int = 3) -> dict[str, Any]:
    """The heaviest /fit, alone (best of ``repeats``) and ``at_once`` together, with the
    health checks polled meanwhile; the issue's body alone."""
    out: dict[str, Any] = {"body_bytes": len(json.dumps(WORST_FIT))}
    issue = [_timed_fits(server, ISSUE_FIT, 1)[0][0] for _ in range(repeats)]
    out["issue_body_alone_s"] = round(min(issue), 3)
    with health_poll(server) as seen:
        cpu = server.cpu_seconds()
        alone = [_timed_fits(server, WORST_FIT, 1)[0][0] for _ in range(repeats)]
        out["alone_s"] = round(min(alone), 3)
        out["alone_cpu_s"] = round((server.cpu_seconds() - cpu) / repeats, 3)
        together, statuses = _timed_fits(server, WORST_FIT, at_once)
    out["at_once"] = at_once
    out["together_s"] = [round(t, 3) for t in sorted(together)]
    out["statuses"] = dict(statuses)
    out["health"] = health_summary(seen)
    return out


def junk(
    server: Server, seconds: float = 5.0, junk_clients: int = 4, keys_count: int = 50_000
) -> dict[str, Any]:
    """/estimate req/s alone, then beside clients posting ``keys_count`` unknown keys each."""
    keys = {f"k{i}": i for i in range(keys_count)}
    junk_body = json.dumps({"model": "llama-3-8b", **keys}).encode()
    good = json.dumps(PRESET_ESTIMATE).encode()

    def estimates(stop_at: float, counts: Counter[int]) -> None:
        client = Client(server.port)
        while time.perf_counter() < stop_at:
            status, _ = client.post("/api/v1/estimate", good)
            counts[status] += 1
        client.close()

    alone: Counter[int] = Counter()
    estimates(time.perf_counter() + seconds, alone)
    beside: Counter[int] = Counter()
    junk_statuses: Counter[int] = Counter()
    stop_at = time.perf_counter() + seconds
    cpu = server.cpu_seconds()

    lock = threading.Lock()

    def poster(_: int) -> None:
        client = Client(server.port)
        while time.perf_counter() < stop_at:
            status, _ = client.post("/api/v1/estimate", junk_body)
            with lock:
                junk_statuses[status] += 1
        client.close()

    threads = [threading.Thread(target=poster, args=(i,)) for i in range(junk_clients)]
    for t in threads:
        t.start()
    estimates(stop_at, beside)
    for t in threads:
        t.join()
    cpu = server.cpu_seconds() - cpu
    junk_count = sum(junk_statuses.values())
    return {
        "junk_keys": keys_count,
        "junk_body_bytes": len(junk_body),
        "estimate_alone_per_s": round(sum(alone.values()) / seconds),
        "estimate_beside_junk_per_s": round(sum(beside.values()) / seconds),
        "junk_per_s": round(junk_count / seconds, 1),
        "server_cpu_ms_per_junk_request": round(1000 * cpu / max(junk_count, 1), 1),
        "statuses": {"estimate": dict(alone + beside), "junk": dict(junk_statuses)},
    }


def mixed(server: Server, threads: int = 8, seconds: float = 10.0) -> dict[str, Any]:
    """``threads`` threads posting the MIXED requests in turn for ``seconds``."""
    statuses: dict[str, Counter[int]] = {path: Counter() for path, _ in MIXED}
    bodies = [(path, json.dumps(body).encode()) for path, body in MIXED]
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def work(k: int) -> None:
        client = Client(server.port)
        i = k
        while time.perf_counter() < stop_at:
            path, body = bodies[i % len(bodies)]
            status, _ = client.post(path, body)
            with lock:
                statuses[path][status] += 1
            i += 1
        client.close()

    with health_poll(server, every_s=0.1) as seen:
        _threads(threads, work)
    return {
        "threads": threads,
        "seconds": seconds,
        "statuses": {path.rsplit("/", 1)[1]: dict(c) for path, c in statuses.items()},
        "health": health_summary(seen),
    }


# ---------------------------------------------------------------------- partial connection flood

#: what each connection of the flood sends: half a request head, and then nothing
HALF_HEAD = b"POST /api/v1/estimate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"


@contextlib.contextmanager
def headroom_serve(
    root: Path, env: dict[str, str], nofile: int
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """``headroom serve`` from ``root`` (one worker, its own HTTP protocol: whatever deadlines
    and connection cap that code has) on a throwaway SQLite database, ``env`` over the
    environment, at most ``nofile`` open files: (port, process)."""
    with tempfile.TemporaryDirectory(prefix="headroom-flood-") as tmp:
        port = api_load.free_port()
        full = {
            **os.environ,
            "PYTHONPATH": str(root),
            "HEADROOM_DATABASE_URL": f"sqlite:///{tmp}/flood.db",
            "HEADROOM_RUN_DIR": f"{tmp}/runs",
            "HEADROOM_LAUNCH_RUNS": "false",
            **env,
        }
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

        def limit_files() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

        command = [sys.executable, "-m", "headroom", "serve", "--port", str(port)]
        with open(Path(tmp) / "server.log", "wb") as log:
            proc = subprocess.Popen(
                command,
                cwd=root,
                env=full,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=limit_files,
            )
        try:
            api_load.wait_ready(f"http://127.0.0.1:{port}", proc)
            yield port, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _estimates(port: int, stop_at: float, client: Client | None) -> dict[str, Any]:
    """Preset /estimate requests until ``stop_at``, on ``client``'s keep-alive connection or
    (None) each on a new one: statuses (0: no answer within 2 s) and the answered ones'
    latency percentiles."""
    body = json.dumps(PRESET_ESTIMATE).encode()
    took: list[float] = []
    statuses: Counter[int] = Counter()
    one = client or Client(port, timeout=2.0)
    while time.perf_counter() < stop_at:
        start = time.perf_counter()
        status, _ = one.post("/api/v1/estimate", body)
        statuses[status] += 1
        if status:
            took.append((time.perf_counter() - start) * 1000)
        if client is None:
            one.close()
    return {
        "statuses": dict(statuses),
        "p50_ms": round(_pct(took, 50), 2),
        "p99_ms": round(_pct(took, 99), 2),
    }


def _side_by_side(port: int, old: Client, seconds: float) -> dict[str, Any]:
    """``_estimates`` for ``seconds`` on ``old``'s connection and on new ones at once."""
    stop_at = time.perf_counter() + seconds
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(keep_alive=_estimates(port, stop_at, old)))
    thread.start()
    out["new_connections"] = _estimates(port, stop_at, None)
    thread.join()
    return out


def flood(
    root: Path,
    held: int,
    seconds: float,
    wait_s: float,
    nofile: int,
    env: dict[str, str],
) -> dict[str, Any]:
    """``held`` connections that each send half a request head and stall, against ``headroom
    serve``: a preset /estimate's latency before and meanwhile (on a keep-alive connection
    opened before the flood and on a new connection per request, side by side, ``seconds``
    each) and after (new connections); how many the server refused as they opened and how long
    it held the others."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < held + 100:  # this process holds them all
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, held + 100), hard))
    out: dict[str, Any] = {"held": held, "server_open_files": nofile, "env": env}
    with headroom_serve(root, env, nofile) as (port, proc):
        old = Client(port, timeout=2.0)  # an old client: connected before the flood
        out["before"] = _side_by_side(port, old, seconds)

        selector = selectors.DefaultSelector()
        opened = failed = 0
        start = time.perf_counter()
        for _ in range(held):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=2.0)
                sock.sendall(HALF_HEAD)
            except OSError:  # refused, reset, or the backlog full: it never got a connection
                failed += 1
                continue
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, time.perf_counter())
            opened += 1
        out["opened"], out["failed_to_open"] = opened, failed
        out["open_s"] = round(time.perf_counter() - start, 2)

        out["during"] = _side_by_side(port, old, seconds)
        old.close()

        # how the held connections end: refused as they opened (503 at once), or closed by
        # the server after a while (a 408, or nothing)
        answers: Counter[str] = Counter()
        held_s: list[float] = []
        deadline = time.perf_counter() + wait_s
        while selector.get_map() and time.perf_counter() < deadline:
            for key, _ in selector.select(timeout=0.5):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                try:
                    answer = conn.recv(200)
                except OSError:
                    answer = b""
                status = answer[9:12].decode(errors="replace") or "closed"
                answers[status] += 1
                if status == "408":  # held to its deadline (a 503 came as it opened)
                    held_s.append(time.perf_counter() - key.data)
                selector.unregister(conn)
                conn.close()
        out["ended"] = dict(answers)  # the status each was answered, or "closed"
        out["still_open_after_s"] = {
            "count": len(selector.get_map()),
            "after_s": round(wait_s, 1),
        }
        out["held_to_408_s"] = {
            "min": round(min(held_s, default=0.0), 2),
            "max": round(max(held_s, default=0.0), 2),
        }
        for key in list(selector.get_map().values()):
            selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()

        out["after"] = _estimates(port, time.perf_counter() + seconds, None)
        out["server_alive"] = proc.poll() is None
    return out


def _sent(port: int, path: str, body: Any) -> socket.socket:
    """A connection that has sent ``POST path`` with ``body``, its answer unread."""
    raw = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=600)
    sock.sendall(head.encode() + raw)
    return sock


def _searches(server: Server) -> dict[str, float]:
    """``/metrics``' search outcomes, ``endpoint/outcome`` -> count (none where they are not
    counted)."""
    status, raw = Client(server.port).call("GET", "/metrics")
    found = re.findall(
        r'^headroom_searches_total\{endpoint="(\w+)",outcome="(\w+)"\} (\S+)$',
        raw.decode() if status == 200 else "",
        re.M,
    )
    return {f"{endpoint}/{outcome}": float(n) for endpoint, outcome, n in found}


def plan(server: Server, repeats: int = 3, dropped: int = 20) -> dict[str, Any]:
    """The worst /plan and the longest bundled one, ``repeats`` times each; then ``dropped``
    long plans whose clients close after 0.2 s, and a small /fit after them (asked
    again every 100 ms while the search queue is full)."""
    out: dict[str, Any] = {"worst_body_bytes": len(json.dumps(WORST_PLAN))}
    client = Client(server.port, timeout=600)
    for name, body in (("worst", WORST_PLAN), ("long", LONG_PLAN)):
        runs = []
        for _ in range(repeats):
            peak, cpu, start = server.peak_rss_mib(), server.cpu_seconds(), time.perf_counter()
            status, raw = client.post("/api/v1/plan", body)
            seconds = time.perf_counter() - start
            answer = json.loads(raw) if raw else {}
            runs.append(
                {
                    "status": status,
                    "seconds": round(seconds, 3),
                    "server_cpu_s": round(server.cpu_seconds() - cpu, 3),
                    "peak_rss_growth_mib": round(server.peak_rss_mib() - peak, 1),
                    "answer": (answer.get("detail") or "")[:160]
                    or {k: answer.get(k) for k in ("layouts_considered", "truncated", "fits")},
                }
            )
        out[name] = runs
    client.close()
    before = _searches(server)
    socks = [_sent(server.port, "/api/v1/plan", LONG_PLAN) for _ in range(dropped)]
    time.sleep(0.2)
    for sock in socks:
        sock.close()
    # a small /fit after them, asked again every 100 ms while the queue is full
    fit = Client(server.port, timeout=600)
    start = time.perf_counter()
    statuses: Counter[int] = Counter()
    first = 0
    while True:
        status, _ = fit.post("/api/v1/fit", MIXED[5][1])
        statuses[status] += 1
        first = first or status
        if status != 503:
            break
        time.sleep(0.1)
    out["dropped"] = dropped
    out["fit_after_dropped"] = {
        "first_status": first,
        "statuses": dict(statuses),
        "answered_after_s": round(time.perf_counter() - start, 3),
    }
    fit.close()
    time.sleep(1.0)  # the searches still in the queue have looked at their clients by now
    after = _searches(server)
    out["dropped_outcomes"] = {
        k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)
    }
    return out


# ---------------------------------------------------------------------------------------- main


def failures(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What fails the run's checks."""
    found = []

    def not_200(section: str, statuses: dict[Any, int]) -> None:
        bad = {s: n for s, n in statuses.items() if int(s) != 200}
        if bad:
            found.append(f"{section}: statuses other than 200: {bad}")

    if "memory" in results:
        m = results["memory"]
        not_200("memory", m["statuses"])
        if m["rss_peak_mib"] > args.max_rss_mib:
            found.append(f"memory: {m['rss_peak_mib']} MiB > {args.max_rss_mib} MiB")
    if "worst" in results:
        w = results["worst"]
        not_200("worst", w["statuses"])
        if max(w["together_s"]) > args.worst_budget_s:
            found.append(f"worst: {max(w['together_s'])} s > {args.worst_budget_s} s")
        for path, h in w["health"].items():
            if h["max_ms"] > args.health_budget_ms:
                found.append(f"worst: {path} took {h['max_ms']} ms > {args.health_budget_ms}")
    for j in results.get("junk", []):
        not_200("junk", j["statuses"]["estimate"])
    if "mixed" in results:
        for path, statuses in results["mixed"]["statuses"].items():
            not_200(f"mixed {path}", statuses)
    if "plan" in results:
        for run in results["plan"]["worst"]:
            if run["status"] != 422 or run["server_cpu_s"] > args.plan_budget_s:
                found.append(f"plan: the worst plan got {run}, not a 422 in budget")
        for run in results["plan"]["long"]:
            if run["status"] != 200:
                found.append(f"plan: the long plan got {run}")
    for f in results.get("flood", []):
        # an old client is served throughout, and everyone once the flood has been shed
        name = f"flood of {f['held']}"
        not_200(f"{name}: the keep-alive client", f["during"]["keep_alive"]["statuses"])
        not_200(f"{name}: after it", f["after"]["statuses"])
        if f["still_open_after_s"]["count"]:
            found.append(f"{name}: {f['still_open_after_s']} held by the server")
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with Server(root=args.root) as server:
        results["server"] = " ".join(server.command[1:]) + f" (cwd {args.root})"
        results["rss_start_mib"] = round(server.rss_mib(), 1)
        if "memory" in args.only:
            results["memory"] = memory(server, args.models)
        if "worst" in args.only:
            results["worst"] = worst(server, args.at_once)
        if "junk" in args.only:
            results["junk"] = [junk(server, args.seconds, keys_count=n) for n in JUNK_KEYS]
        if "mixed" in args.only:
            results["mixed"] = mixed(server, args.threads, args.mixed_seconds)
        if "plan" in args.only:
            results["plan"] = plan(server, args.plan_repeats, args.plan_dropped)
        results["rss_end_mib"] = round(server.rss_mib(), 1)
    if "flood" in args.only:  # its own server: headroom serve's protocol, a file limit
        env = {}
        if args.flood_head_timeout_s is not None:
            env["HEADROOM_HEAD_TIMEOUT_S"] = str(args.flood_head_timeout_s)
        results["flood"] = [
            flood(args.root, held, args.flood_seconds, args.flood_wait_s, args.flood_nofile, env)
            for held in args.flood_held
        ]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout the server runs")
    parser.add_argument("--models", type=int, default=1000, help="memory: distinct models")
    parser.add_argument("--at-once", type=int, default=4, help="worst: fits at once")
    parser.add_argument("--seconds", type=float, default=5.0, help="junk: seconds per phase")
    parser.add_argument("--threads", type=int, default=8, help="mixed: client threads")
    parser.add_argument("--mixed-seconds", type=float, default=10.0, help="mixed: seconds")
    parser.add_argument("--max-rss-mib", type=float, default=320.0, help="memory: bound")
    parser.add_argument("--worst-budget-s", type=float, default=10.0, help="worst: bound")
    parser.add_argument("--health-budget-ms", type=float, default=100.0, help="worst: bound")
    parser.add_argument(
        "--flood-held",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[500, 10_000],
        help="flood: partial connections held, one run each (comma-separated)",
    )
    parser.add_argument("--flood-seconds", type=float, default=3.0, help="flood: per phase")
    parser.add_argument(
        "--flood-wait-s", type=float, default=30.0, help="flood: most the server may hold them"
    )
    parser.add_argument(
        "--flood-nofile", type=int, default=8192, help="flood: the server's open-file limit"
    )
    parser.add_argument(
        "--flood-head-timeout-s", type=float, default=None, help="flood: the server's setting"
    )
    parser.add_argument("--plan-repeats", type=int, default=3, help="plan: posts of each")
    parser.add_argument("--plan-dropped", type=int, default=20, help="plan: dropped clients")
    parser.add_argument(
        "--plan-budget-s", type=float, default=2.0, help="plan: the worst plan's server CPU"
    )
    args = parser.parse_args()
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; allowed: {SECTIONS}")
    print(f"machine: {api_load.machine()}")
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    results = run(args)
    for key, value in results.items():
        print(f"{key}: {json.dumps(value)}")
    found = failures(results, args)
    for line in found:
        print(f"FAILED {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
