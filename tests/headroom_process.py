"""The tests' one way to run the ``headroom`` command in its own process, as a user does, and
to serve the API from one. Both are bound children (``tests/processes``): bounded in time, and
nothing they start outlives the test, even a test process that is SIGKILLed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import processes


def run_headroom(
    *args: str, timeout: float = 300, **options: Any
) -> subprocess.CompletedProcess[str]:
    """``headroom ARGS`` with this interpreter, its output captured as text; ``options`` go to
    ``subprocess.run`` (``env``, ``cwd``). Past ``timeout`` it and all it started are killed
    (``subprocess.TimeoutExpired``)."""
    return processes.run([sys.executable, "-m", "headroom", *args], timeout=timeout, **options)


def run_wide(*args: str) -> subprocess.CompletedProcess[str]:
    """``headroom ARGS`` printing to a 400-column terminal: rich wraps no line a test reads."""
    return run_headroom(*args, env={**os.environ, "COLUMNS": "400"})


@dataclass(frozen=True)
class Served:
    """A running ``headroom serve``: its base URL, port and process."""

    url: str
    port: int
    process: subprocess.Popen[bytes]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_headroom(env: dict[str, str], log: Path, timeout: float = 60) -> Iterator[Served]:
    """``headroom serve`` on a free local port with ``env`` added to this environment, its
    output in ``log``; yields once ``/readyz`` answers 200. Afterwards it is stopped
    (SIGTERM, SIGKILL after 30 s) with whatever it started, its trainers included."""
    port = _free_port()
    with log.open("ab") as out:
        process = processes.popen(
            [sys.executable, "-m", "headroom", "serve", "--port", str(port)],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    served = Served(f"http://127.0.0.1:{port}", port, process)
    try:
        deadline = time.monotonic() + timeout
        while not _ready(served.url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"headroom serve did not start:\n{log.read_text()}")
            time.sleep(0.1)
        yield served
    finally:
        processes.stop(process, grace_s=30)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False
