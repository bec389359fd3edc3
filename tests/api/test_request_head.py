"""Request heads are bounded where ``headroom serve`` parses them.

A head (request line and header fields) over 32 KiB is answered 431 and the connection closed,
a request line alone over it 414, more than 100 header fields 431; the server stops reading a
huge header at the limit instead of parsing it whole (a 64 MiB header took 5 s and its size in
memory), and heads under the limit, keep-alive, pipelining and bodies larger than the head limit
work as before. Raw sockets against a real ``headroom serve`` process.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from headroom_process import Served, serve_headroom

from headroom.api.protocol import MAX_HEAD_BYTES, MAX_HEADER_FIELDS


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("head")
    env = {
        "HEADROOM_DATABASE_URL": f"sqlite:///{tmp / 'headroom.db'}",
        "HEADROOM_RUN_DIR": str(tmp / "runs"),
        "HEADROOM_LAUNCH_RUNS": "false",
    }
    with serve_headroom(env, tmp / "serve.log") as served:
        yield served


def _read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response from ``sock`` (``buffer`` holds what was read past it)."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {bytes(buffer)[:200]!r}")
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    buffer[:] = rest[length:]
    return int(status_line.split()[1]), headers, rest[:length]


def _exchange(port: int, *requests: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``requests`` on one connection at once (pipelined), read one response each."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"".join(requests))
        buffer = bytearray()
        return [_read_response(sock, buffer) for _ in requests]


def _get(path: str, headers: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: test\r\n" + headers + b"\r\n"


def _peak_rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    assert match, status
    return int(match.group(1)) * 1024


def test_a_huge_header_is_refused_at_the_limit_without_being_read(served: Served) -> None:
    total = 64 * 2**20
    before = _peak_rss_bytes(served.process.pid)
    received: list[bytes] = []
    sent = 0
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:

        def read() -> None:
            try:
                while chunk := sock.recv(65536):
                    received.append(chunk)
            except OSError:  # reset by the server, which closed with our bytes unread
                pass

        reader = threading.Thread(target=read)
        reader.start()
        chunk = b"a" * 65536
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Big: ")
            while sent < total:
                sock.sendall(chunk)
                sent += len(chunk)
            sock.sendall(b"\r\n\r\n")
        except OSError:  # the server closed the connection: it read no further
            pass
        reader.join(timeout=60)
    answer = b"".join(received)
    # the server gave up long before the end (what it took is the limit plus socket buffers)
    assert sent < total // 4, f"the server read {sent} of {total} bytes"
    if answer:  # the 431 (a reset may discard it before the client reads it)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    # the parser never held the header: the server's peak memory barely moved
    assert _peak_rss_bytes(served.process.pid) - before < 16 * 2**20


def test_a_head_over_the_limit_gets_431_problem_json(served: Served) -> None:
    big = b"X-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n"
    [(status, headers, body)] = _exchange(served.port, _get("/healthz", big))
    assert status == 431
    assert headers["content-type"] == "application/problem+json"
    assert headers["connection"] == "close"
    problem = json.loads(body)
    assert problem["status"] == 431
    assert problem["detail"] == f"the request head is larger than {MAX_HEAD_BYTES} bytes"


def test_too_many_header_fields_get_431(served: Served) -> None:
    fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(MAX_HEADER_FIELDS))  # plus Host
    [(status, _, body)] = _exchange(served.port, _get("/healthz", fields))
    assert status == 431
    assert json.loads(body)["detail"] == (
        f"a request carries at most {MAX_HEADER_FIELDS} header fields"
    )


def test_a_request_line_over_the_limit_gets_414(served: Served) -> None:
    [(status, _, body)] = _exchange(served.port, _get("/healthz?q=" + "a" * MAX_HEAD_BYTES))
    assert status == 414
    assert json.loads(body)["title"] == "URI Too Long"


def test_heads_under_the_limit_bodies_over_it_keep_alive_and_pipelining_work(
    served: Served,
) -> None:
    near = b"X-Near: " + b"a" * (MAX_HEAD_BYTES - 200) + b"\r\n"
    fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(MAX_HEADER_FIELDS - 1))
    # a body three times the head limit, in the same read as its head (four would pass the
    # planning routes' own 128 KiB)
    body = json.dumps({"model": "llama-3-8b"}).encode() + b" " * (3 * MAX_HEAD_BYTES)
    post = (
        b"POST /api/v1/estimate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    responses = _exchange(
        served.port, _get("/healthz", near), post, _get("/healthz", fields), post, _get("/readyz")
    )
    assert [status for status, _, _ in responses] == [200, 200, 200, 200, 200]
    assert "fits" in json.loads(responses[1][2])
