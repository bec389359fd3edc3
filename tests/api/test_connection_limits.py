"""Connections that do not send their request are not held: ``headroom serve`` times out a
request's head and body, and holds at most ``HEADROOM_MAX_CONNECTIONS`` connections.

uvicorn timed out only an idle keep-alive connection: a client that opened a connection and
sent nothing, half a head or half a body was held for as long as it liked, and 21,000 such
connections stopped the service. Raw sockets against a real ``headroom serve`` process with
short deadlines (head 3 s, body 4 s) and a cap of 40 connections.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from headroom_process import Served, run_headroom, serve_headroom

HEAD_TIMEOUT_S = 3
BODY_TIMEOUT_S = 4
MAX_CONNECTIONS = 40
#: how long a test waits for the server to act before it fails (well past every deadline)
WAIT_S = 30.0
HALF_HEAD = b"POST /api/v1/estimate HTTP/1.1\r\nHost: test\r\nContent-Ty"
ESTIMATE = json.dumps({"model": "llama-3-8b"}).encode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("limits")
    env = {
        "HEADROOM_DATABASE_URL": f"sqlite:///{tmp / 'headroom.db'}",
        "HEADROOM_RUN_DIR": str(tmp / "runs"),
        "HEADROOM_LAUNCH_RUNS": "false",
        "HEADROOM_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        "HEADROOM_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "HEADROOM_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    }
    with serve_headroom(env, tmp / "serve.log") as served:
        yield served


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def _until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a reset ends it too)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        raise AssertionError(f"the server kept the connection {WAIT_S:g} s") from None
    except ConnectionResetError:
        pass
    return received


def _problem(answer: bytes, status: int) -> tuple[dict[str, str], dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    assert status_line.startswith(f"HTTP/1.1 {status} "), answer[:300]
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    assert headers["content-type"] == "application/problem+json"
    assert headers["connection"] == "close"
    return headers, json.loads(body)


def _post(body: bytes, length: int | None = None) -> bytes:
    """The head of a POST /estimate of ``body`` (its Content-Length: ``length``, if given)."""
    return (
        b"POST /api/v1/estimate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length)
    )


def _answered(port: int) -> int:
    """The status of a preset's estimate on a new connection."""
    with _connect(port) as sock:
        sock.sendall(_post(ESTIMATE) + ESTIMATE)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed without an answer: {answer!r}")
            answer += chunk
    return int(answer.split()[1])


def _status_or_reset(port: int) -> int | None:
    """``_answered``, or None for a connection closed or reset before its answer."""
    try:
        return _answered(port)
    except TimeoutError:
        raise
    except OSError:  # ConnectionError and its resets
        return None


def test_half_a_head_is_answered_408_after_the_head_timeout(served: Served) -> None:
    with _connect(served.port) as sock:
        sock.sendall(HALF_HEAD)
        start = time.monotonic()
        answer = _until_closed(sock)
        held = time.monotonic() - start
    _, problem = _problem(answer, 408)
    assert problem["detail"] == f"the request head did not arrive within {HEAD_TIMEOUT_S} s"
    assert held > HEAD_TIMEOUT_S / 2  # held for its deadline, not refused at once


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(served: Served) -> None:
    with _connect(served.port) as sock:
        assert _until_closed(sock) == b""  # nothing of a request came: nothing to answer


def test_a_head_trickled_a_byte_at_a_time_is_cut_at_its_deadline(served: Served) -> None:
    """The deadline is the whole head's, not one between two reads."""
    head = HALF_HEAD + b"".join(b"X-Pad-%d: 1\r\n" % i for i in range(1000))
    answer = b""
    with _connect(served.port) as sock:
        deadline = time.monotonic() + WAIT_S
        for byte in head:
            if select.select([sock], [], [], 0.1)[0]:
                break
            assert time.monotonic() < deadline, "the server read a trickled head for 30 s"
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = _until_closed(sock)
    if answer:  # the 408 (a reset may discard it before the client reads it)
        _, problem = _problem(answer, 408)
        assert "the request head did not arrive" in str(problem["detail"])


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_half_a_body_is_answered_408_after_the_body_timeout(served: Served, chunked: bool) -> None:
    with _connect(served.port) as sock:
        if chunked:
            sock.sendall(
                b"POST /api/v1/estimate HTTP/1.1\r\nHost: test\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                b'5\r\n{"mod\r\n'
            )
        else:
            sock.sendall(_post(ESTIMATE, length=len(ESTIMATE) + 100) + ESTIMATE)
        answer = _until_closed(sock)
    _, problem = _problem(answer, 408)
    assert problem["detail"] == f"the request body did not arrive within {BODY_TIMEOUT_S} s"


def test_others_are_answered_while_partial_connections_are_held(served: Served) -> None:
    with ExitStack() as stack:
        held = [stack.enter_context(_connect(served.port)) for _ in range(MAX_CONNECTIONS // 2)]
        for i, sock in enumerate(held):
            sock.sendall(HALF_HEAD if i % 2 else _post(ESTIMATE, length=1000) + ESTIMATE)
        assert [_answered(served.port) for _ in range(5)] == [200] * 5
        # the held ones were still held meanwhile, and each ends with its 408
        for sock in held:
            _problem(_until_closed(sock), 408)
    assert _answered(served.port) == 200


def test_past_the_connection_cap_a_new_connection_gets_503_and_the_service_recovers(
    served: Served,
) -> None:
    with ExitStack() as stack:
        held = [stack.enter_context(_connect(served.port)) for _ in range(MAX_CONNECTIONS)]
        # one past the cap: answered 503 as it opens, without sending a byte
        with _connect(served.port) as past:
            answer = _until_closed(past)
        headers, problem = _problem(answer, 503)
        assert headers["retry-after"] == "1"
        assert problem["detail"] == (
            f"the server holds its most connections ({MAX_CONNECTIONS}); retry later"
        )
        # a request that comes with its connection gets the 503, or a reset (its bytes unread)
        assert _status_or_reset(served.port) in (503, None)
        # the connections held are served as before
        held[0].sendall(_post(ESTIMATE) + ESTIMATE)
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200 ")
        # past the head timeout the server closes the idle ones, and takes new ones again
        for sock in held[1:]:
            assert _until_closed(sock) == b""
    deadline = time.monotonic() + WAIT_S
    while (status := _status_or_reset(served.port)) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 200


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("HEADROOM_HEAD_TIMEOUT_S", "0", "Input should be greater than 0, got '0'"),
        ("HEADROOM_BODY_TIMEOUT_S", "7200", "Input should be less than or equal to 3600"),
        ("HEADROOM_MAX_CONNECTIONS", "many", "Input should be a valid integer"),
    ],
)
def test_a_bad_limit_stops_headroom_serve_naming_it(
    variable: str, value: str, message: str
) -> None:
    result = run_headroom("serve", "--port", "1", timeout=60, env={**os.environ, variable: value})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {variable}: {message}"), result.stderr
