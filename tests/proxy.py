"""A TCP proxy on loopback that a test can make stop answering.

Used to stand for a broker that goes silent mid-batch without touching the
shared server: the proxy keeps forwarding what the client sends but holds
back the server's replies while it is paused.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Self

__all__ = ["PausableProxy"]


class PausableProxy:
    """Forward ``127.0.0.1:<port>`` to *target*; :meth:`pause` holds the replies."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._answering = threading.Event()
        self._answering.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        #: Client connections accepted, and those the client has closed since.
        self.accepted = 0
        self.closed_by_client = 0

    def url(self, scheme_url: str) -> str:
        """Return *scheme_url* (``amqp://user:pw@host:port/vhost``) pointed at the proxy."""
        head, _, tail = scheme_url.partition("@")
        _, _, path = tail.partition("/")
        return f"{head}@127.0.0.1:{self.port}/{path}"

    def pause(self) -> None:
        """Stop passing the server's replies to the client (requests still go through)."""
        self._answering.clear()

    def resume(self) -> None:
        self._answering.set()

    def open_clients(self) -> int:
        """How many client connections are open (the client has not closed them)."""
        with self._lock:
            return self.accepted - self.closed_by_client

    def __enter__(self) -> Self:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        self._answering.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, server]
                self.accepted += 1
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    if not replies:
                        with self._lock:
                            self.closed_by_client += 1
                    break
                while replies and not self._answering.wait(0.1):
                    if self._closed.is_set():
                        return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
