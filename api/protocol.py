"""The HTTP/1.1 protocol ``headroom serve`` runs: uvicorn's httptools protocol with a bounded
request head, deadlines on a request's head and body, and a cap on connections.

httptools (llhttp) reads a request line and header fields of any length and hands each field
over only once it is complete, joining its pieces as it goes: a 16 MiB header took 5.5 s to
parse and was then answered like any other request, past the body limit. Here the bytes of a
request head are counted as they arrive; beyond ``MAX_HEAD_BYTES`` (or ``MAX_HEADER_FIELDS``
fields) the server answers 431 (414 for the request line alone) and closes the connection,
so a head costs at most one socket read past the limit. uvicorn's h11 protocol has its own
bound (``h11_max_incomplete_event_size``, 16 KiB by default).

uvicorn times out only an idle keep-alive connection: one that opened and sent nothing, half a
head or half a body was held for as long as its client liked, and 21,000 of them stopped the
service. Here a head must arrive within ``HEADROOM_HEAD_TIMEOUT_S`` (10 s) of the connection's
start or of its first byte, and a body within ``HEADROOM_BODY_TIMEOUT_S`` (30 s) of its head;
past that the connection is closed, after a 408 problem if part of a request came. A deadline
waits while the server is the one not reading (its application has not taken what came, or a
pipelined request waits for the one before). And a process holds at most
``HEADROOM_MAX_CONNECTIONS`` (1,000): a connection past them is answered 503 (``Retry-After``)
and closed as it opens, while those held are served as before. uvicorn's ``limit_concurrency``
is no such cap: it counts connections but accepts every one, answering 503 only once a request
head is complete, and to every connection alike.

Run it with ``uvicorn --http headroom.api.protocol:HeadLimitedProtocol``; ``headroom serve``
does. It reads its limits from the environment (``api.settings.Settings``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from headroom.api.settings import Settings

#: longest request head (request line and header fields) accepted, in bytes
MAX_HEAD_BYTES = 32 * 1024
#: most header fields one request may carry
MAX_HEADER_FIELDS = 100

#: seconds a client refused for the connection cap is asked to wait
RETRY_AFTER_S = 1

_REASONS = {
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


class _Refusals:
    """The refusals of one process, logged at most once per ``every_s`` with their counts: a
    flood of connections must not become a flood of log lines."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s, self.counts, self.logged_at = every_s, Counter[str](), -every_s
        self.flush: asyncio.TimerHandle | None = None

    def note(self, loop: asyncio.AbstractEventLoop, logger: logging.Logger, what: str) -> None:
        self.counts[what] += 1
        wait = self.logged_at + self.every_s - time.monotonic()
        if wait <= 0:
            self.log(logger)
        elif self.flush is None:  # the ones still to come in this window are logged at its end
            self.flush = loop.call_later(wait, self.log, logger)

    def log(self, logger: logging.Logger) -> None:
        if self.flush is not None:
            self.flush.cancel()
            self.flush = None
        if self.counts:
            tally = "; ".join(f"{what} (x{n})" for what, n in self.counts.items())
            logger.warning("Refused: %s.", tally)
        self.counts.clear()
        self.logged_at = time.monotonic()


_refusals = _Refusals()


@functools.cache
def _settings() -> Settings:
    """The service's settings, read once per process (the protocol is built per connection)."""
    return Settings()


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing request heads over the limits above, timing out
    heads and bodies that do not arrive, and refusing connections past the cap."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the current head's bytes as received (counted per read until the head is complete)
        # and as parsed (exact: the URL and every complete field), and its fields
        self._in_head, self._received, self._parsed, self._fields = True, 0, 0, 0
        self._refused = False
        settings = _settings()
        self.head_timeout_s, self.body_timeout_s = settings.head_timeout_s, settings.body_timeout_s
        self.max_connections = settings.max_connections
        # the one deadline running: the head's (from the connection's start or the head's
        # first byte to its end) or the body's (from the head's end to the body's): when it is
        # due, what then, and the loop's timer that looks (moved along, not re-made, per
        # request: a timer made and cancelled per head and per body cost 15 µs a request)
        self._due = 0.0
        self._then: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head_begun = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            # before a byte is read: a flood of connections costs an accept and a write each
            self._refuse(
                503,
                f"the server holds its most connections ({self.max_connections}); retry later",
                headers=[(b"retry-after", b"%d" % RETRY_AFTER_S)],
            )
            return
        self._arm(self.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._received += len(data)
        super().data_received(data)
        # a head still incomplete after this read is all in the parser's buffers
        if self._in_head and self._received > MAX_HEAD_BYTES and not self._refused:
            self._refuse(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._parsed, self._fields = True, 0, 0
        self._head_begun = True
        self._arm(self.head_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._parsed += len(url)
        if self._parsed > MAX_HEAD_BYTES:
            self._refuse(414, f"the request target is longer than {MAX_HEAD_BYTES} bytes")
        elif not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed += len(name) + len(value) + 4  # ": " and CRLF
        self._fields += 1
        if self._parsed > MAX_HEAD_BYTES:
            self._refuse(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
        elif self._fields > MAX_HEADER_FIELDS:
            self._refuse(431, f"a request carries at most {MAX_HEADER_FIELDS} header fields")
        elif not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._received = False, 0
        self._head_begun = False
        if not self._refused:
            self._arm(self.body_timeout_s, self._body_timed_out)
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head = True
        self._disarm()
        if self._refused:
            return
        if self.cycle is not None and self.cycle.response_complete:
            # answered before its body was in (a write refused for its token): the connection
            # now waits for the next head, and uvicorn's keep-alive wait ended with that body
            self._arm(self.head_timeout_s, self._head_timed_out)
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the connection is the WebSocket protocol's from here
        super().handle_websocket_upgrade()

    def send_400_response(self, msg: str) -> None:
        # the parser may still fail on the rest of a read after a refusal: one answer only
        if not self._refused:
            self._disarm()
            super().send_400_response(msg)

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        """``then()`` in ``seconds``, in place of any deadline running."""
        self._due, self._then = self.loop.time() + seconds, then
        if self._timer is not None and self._timer.when() > self._due:  # due sooner
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = self.loop.call_at(self._due, self._look)

    def _disarm(self) -> None:
        self._then = None  # the timer finds nothing due

    def _look(self) -> None:
        self._timer = None
        if self._then is None or self.transport.is_closing():
            return
        if self.loop.time() < self._due:  # moved along since the timer was set
            self._timer = self.loop.call_at(self._due, self._look)
            return
        then, self._then = self._then, None
        then()

    def _head_timed_out(self) -> None:
        answering = self.cycle is not None and not self.cycle.response_complete
        if self.flow.read_paused or answering:
            # the server is the one behind (a pipelined head waits for the answer before it)
            self._arm(self.head_timeout_s, self._head_timed_out)
        elif self._head_begun:
            self._refuse(408, f"the request head did not arrive within {self.head_timeout_s:g} s")
        else:  # nothing of a request came: nothing to answer
            self.transport.close()

    def _body_timed_out(self) -> None:
        if self.flow.read_paused:  # the application has not taken what came: not the client's
            self._arm(self.body_timeout_s, self._body_timed_out)
            return
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            # answered already: the rest of the body is not waited for
            self.transport.close()
            return
        # the application waits for the body: it is told of the disconnection, and anything it
        # sends after is dropped, not written after the 408
        cycle.disconnected = True
        cycle.message_event.set()
        self._refuse(408, f"the request body did not arrive within {self.body_timeout_s:g} s")

    def _refuse(
        self,
        status: int,
        detail: str,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Answer ``status`` as problem+json and close the connection; nothing reaches the app."""
        if self._refused:
            return
        self._refused = True
        self._disarm()
        _refusals.note(self.loop, self.logger, f"{status}: {detail}")
        title = _REASONS[status].decode()
        body = json.dumps(
            {"type": "about:blank", "title": title, "status": status, "detail": detail}
        )
        content = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
        for name, value in [*self.server_state.default_headers, *(headers or [])]:
            content += [name, b": ", value, b"\r\n"]
        content += [
            b"content-type: application/problem+json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body.encode(),
        ]
        self.transport.write(b"".join(content))
        self.transport.close()
