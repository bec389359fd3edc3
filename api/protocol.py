"""The HTTP/1.1 protocol ``headroom serve`` runs: uvicorn's httptools protocol with a bounded
request head.

httptools (llhttp) reads a request line and header fields of any length and hands each field
over only once it is complete, joining its pieces as it goes: a 16 MiB header took 5.5 s to
parse and was then answered like any other request, past the body limit. Here the bytes of a
request head are counted as they arrive; beyond ``MAX_HEAD_BYTES`` (or ``MAX_HEADER_FIELDS``
fields) the server answers 431 (414 for the request line alone) and closes the connection,
so a head costs at most one socket read past the limit. uvicorn's h11 protocol has its own
bound (``h11_max_incomplete_event_size``, 16 KiB by default).

Run it with ``uvicorn --http headroom.api.protocol:HeadLimitedProtocol``; ``headroom serve``
does.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: longest request head (request line and header fields) accepted, in bytes
MAX_HEAD_BYTES = 32 * 1024
#: most header fields one request may carry
MAX_HEADER_FIELDS = 100

_REASONS = {414: b"URI Too Long", 431: b"Request Header Fields Too Large"}


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing request heads over the limits above."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the current head's bytes as received (counted per read until the head is complete)
        # and as parsed (exact: the URL and every complete field), and its fields
        self._in_head, self._received, self._parsed, self._fields = True, 0, 0, 0
        self._refused = False

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
        if not self._refused:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head = True
        if not self._refused:
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # the parser may still fail on the rest of a read after a refusal: one answer only
        if not self._refused:
            super().send_400_response(msg)

    def _refuse(self, status: int, detail: str) -> None:
        """Answer ``status`` as problem+json and close the connection; nothing reaches the app."""
        if self._refused:
            return
        self._refused = True
        self.logger.warning("Refused a request: %s.", detail)
        title = _REASONS[status].decode()
        body = json.dumps(
            {"type": "about:blank", "title": title, "status": status, "detail": detail}
        )
        content = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
        for name, value in self.server_state.default_headers:
            content += [name, b": ", value, b"\r\n"]
        content += [
            b"content-type: application/problem+json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body.encode(),
        ]
        self.transport.write(b"".join(content))
        self.transport.close()
