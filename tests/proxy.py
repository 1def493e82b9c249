"""A TCP proxy on loopback that a test can make stop answering.

Used to stand for a broker that goes silent mid-batch without touching the
shared server: the proxy keeps forwarding what the client sends but holds
back the server's replies while it is paused.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the tests run on 3.10 too
    from typing_extensions import Self

__all__ = ["OutageHTTPProxy", "PausableProxy"]


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


class OutageHTTPProxy:
    """Forward HTTP requests to ``127.0.0.1:<target_port>`` (moto's SQS).

    While :attr:`outage` is set, the AWS operations named in it are answered
    with HTTP 503 ``ServiceUnavailable``, as AWS does when it is in trouble;
    every other request is forwarded.
    """

    def __init__(self, target_port: int) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self
        #: AWS operations (``SendMessage``) answered with a 503 while set.
        self.outage: set[str] = set()
        #: Requests answered with a 503 so far.
        self.refused = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                operation = (self.headers.get("X-Amz-Target") or "").rpartition(".")[2]
                if operation in proxy.outage:
                    proxy.refused += 1
                    error = b'{"__type":"ServiceUnavailable","message":"Service Unavailable"}'
                    self._answer(503, {"Content-Type": "application/x-amz-json-1.0"}, error)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", target_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    upstream.request("POST", self.path, body=body, headers=headers)
                    reply = upstream.getresponse()
                    kept = {k: v for k, v in reply.getheaders() if k.lower() != "connection"}
                    self._answer(reply.status, kept, reply.read())
                finally:
                    upstream.close()

            def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
