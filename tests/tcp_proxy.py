"""A TCP proxy the tests put between the service and its database, to take the database away
and give it back: ``stop()`` closes the listening socket and every open connection (as a
database that went down would), ``start()`` listens on the same port again."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` while started."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> TcpProxy:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Listen (on the port of the first start, when restarted) and forward."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """Stop listening and close every connection, in both directions."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # stopped
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # stopped meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets |= {client, upstream}
            pumps = [
                threading.Thread(target=self._pump, args=(source, sink), daemon=True)
                for source, sink in ((client, upstream), (upstream, client))
            ]
            for pump in pumps:
                pump.start()
            closer = threading.Thread(target=self._close, args=(pumps, client, upstream))
            closer.daemon = True
            closer.start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):  # one side ended: so does the connection
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _close(self, pumps: list[threading.Thread], *sockets: socket.socket) -> None:
        for pump in pumps:
            pump.join()
        with self._lock:
            self._sockets -= set(sockets)
        for sock in sockets:
            sock.close()
