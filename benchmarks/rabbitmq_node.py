"""A private RabbitMQ node, so a benchmark can restart a broker nobody else uses.

The machine's RabbitMQ (``rabbit@localhost``) serves other work; restarting
it would cut their connections. :class:`RabbitMQNode` starts a second node of
the same installation (``rabbitmq-server -detached`` with its own node name,
ports, data and log directories, no plugins) on free loopback ports, restarts
it (``rabbitmqctl stop``, then the same start: its data directory, and with it
every durable queue and persistent message, is kept) and removes it at the end.
It needs ``rabbitmq-server`` and ``rabbitmqctl`` run by a user they work for
(root here: the scripts switch to the ``rabbitmq`` user, who must own the
node's directory).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from celery_zdelay.testing import free_port

#: Seconds a node may take to boot on a loaded 2-core machine.
START_TIMEOUT = 120.0


class RabbitMQNodeError(RuntimeError):
    """The private node could not be started or stopped (the reason says why)."""


class RabbitMQNode:
    """A private RabbitMQ node on free loopback ports; guest/guest on vhost ``/``."""

    def __init__(self) -> None:
        self.name = f"zbench-{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="zbench-rabbitmq-"))
        (self._dir / "enabled_plugins").write_text("[].\n")
        (self._dir / "rabbitmq.conf").write_text(f"listeners.tcp.default = 127.0.0.1:{self.port}\n")
        # The start scripts run the node as the rabbitmq user: it must own its files.
        with_owner = pwd.getpwnam("rabbitmq")
        for path in (self._dir, *self._dir.iterdir()):
            os.chown(path, with_owner.pw_uid, with_owner.pw_gid)
        self.running = False

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``rabbitmqctl -n <this node> ARGS``; the caller checks the return code."""
        return subprocess.run(
            ["rabbitmqctl", "-q", "-n", self.name, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start(self) -> RabbitMQNode:
        env = {
            **os.environ,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self._dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self._dir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self._dir / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self._dir / "rabbitmq.conf"),
        }
        started = subprocess.run(
            ["rabbitmq-server", "-detached"], env=env, capture_output=True, text=True, check=False
        )
        if started.returncode:
            raise RabbitMQNodeError(f"rabbitmq-server -detached: {started.stderr[-500:]}")
        self.running = True
        # -detached returns at once; the node registers, then boots.
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.ctl("await_startup", "--timeout", "10", timeout=30).returncode == 0:
                return self
            time.sleep(0.5)
        self.stop()
        raise RabbitMQNodeError(f"RabbitMQ node {self.name} did not boot in {START_TIMEOUT:g}s")

    def restart(self) -> None:
        """Stop the node cleanly and start it again on the same ports and data."""
        self._stop_node()
        self.start()

    def stop(self) -> None:
        """Stop the node and remove its files."""
        self._stop_node()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_node(self) -> None:
        if self.running:
            # rabbitmqctl stop waits until the node's process has exited.
            self.ctl("stop", timeout=120)
            self.running = False
