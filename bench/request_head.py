"""What ``headroom serve``'s HTTP protocol adds per request: uvicorn's httptools protocol against
``headroom.api.protocol.HeadLimitedProtocol`` (the same, counting the request head's bytes and
fields), each parsing the same keep-alive ``POST /api/v1/estimate`` request (five header fields,
a 27-byte body) over and over on one connection. Only the parsing and the protocol's callbacks
are timed: no application runs, nothing is sent.

Run: .venv/bin/python bench/request_head.py [--requests 20000] [--batches 5]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from headroom.api.protocol import HeadLimitedProtocol

REQUEST = (
    b"POST /api/v1/estimate HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: wrk\r\n"
    b"Content-Type: application/json\r\nContent-Length: 27\r\nAccept: */*\r\n\r\n"
    b'{"model": "llama-3-8b"}    '
)


class _Transport:
    """A connection that takes everything and sends nothing."""

    def __init__(self) -> None:
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _app(scope: Any, receive: Any, send: Any) -> None:
    pass


def _per_request_us(cls: type[HttpToolsProtocol], config: Config, requests: int) -> float:
    protocol = cls(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(_Transport())  # type: ignore[arg-type]
    protocol._start_asgi_task = lambda cycle, app: None  # type: ignore[method-assign]
    start = time.perf_counter()
    for _ in range(requests):
        protocol.data_received(REQUEST)
        protocol.cycle.response_complete = True  # as if answered: the next request parses
    return (time.perf_counter() - start) / requests * 1e6


async def main(requests: int, batches: int) -> None:
    config = Config(app=_app, lifespan="off")
    config.load()
    times: dict[str, list[float]] = {}
    for _ in range(batches):  # interleaved, so both see the same machine
        for cls in (HttpToolsProtocol, HeadLimitedProtocol):
            times.setdefault(cls.__name__, []).append(_per_request_us(cls, config, requests))
    print(f"{platform.processor() or platform.machine()}; CPython {platform.python_version()}")
    print(f"{requests} requests x {batches} batches\n")
    print("| protocol | µs per request (median) | min | max |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in times.items():
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.batches))
