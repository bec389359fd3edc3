"""The tests' one way to run the ``headroom`` command in its own process, as a user does, and
to serve the API from one."""

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


def run_headroom(
    *args: str, timeout: float = 300, **options: Any
) -> subprocess.CompletedProcess[str]:
    """``headroom ARGS`` with this interpreter, its output captured as text; ``options`` go to
    ``subprocess.run`` (``env``, ``cwd``)."""
    return subprocess.run(
        [sys.executable, "-m", "headroom", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **options,
    )


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
    output in ``log``; yields once ``/readyz`` answers 200, stops it (SIGTERM) afterwards."""
    port = _free_port()
    with log.open("ab") as out:
        process = subprocess.Popen(
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
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False
