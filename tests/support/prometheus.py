"""A real Prometheus server (Debian's ``prometheus``) scraping loopback targets, for tests.

It is started with a configuration of its own on a free loopback port, with
its storage in a temporary folder, and queried through its HTTP API as
Grafana queries it. Without the binary a test skips, except in CI
(``CI=true``), where it fails: ``make prometheus`` installs it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from celery_zdelay.testing import free_port
from tests.helpers import unavailable, wait_for

__all__ = ["Prometheus", "prometheus_binary"]


def prometheus_binary() -> str:
    """The path of the ``prometheus`` binary; skip (fail in CI) without one."""
    found = shutil.which("prometheus")
    if found is None:
        unavailable("prometheus is not installed: make prometheus (Debian's package)")
    return found


class Prometheus:
    """``prometheus`` scraping *targets* (host:port) every second as job *job*."""

    def __init__(self, targets: list[str], *, job: str) -> None:
        self.job = job
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="zdelay-prometheus-"))
        config = self._dir / "prometheus.yml"
        # JSON is YAML: no YAML writer needed.
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": job,
                            "scrape_timeout": "1s",
                            "static_configs": [{"targets": targets}],
                        }
                    ],
                }
            )
        )
        self._log = open(self._dir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self._process = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def __enter__(self) -> Prometheus:
        wait_for(self._ready, timeout=60, message=lambda: f"Prometheus up: {self.log()[-2000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=10)
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def log(self) -> str:
        return (self._dir / "prometheus.log").read_text(errors="replace")

    def _ready(self) -> bool:
        if self._process.poll() is not None:
            raise AssertionError(f"Prometheus exited: {self.log()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: Any) -> Any:
        """GET ``/api/v1/<path>``; return its ``data``, or fail with Prometheus's error."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of *expr* now."""
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def query_range(self, expr: str, *, seconds: float, step: float) -> list[dict[str, Any]]:
        """The series of *expr* over the last *seconds*, as a Grafana time series panel asks."""
        end = time.time()
        result: list[dict[str, Any]] = self.api(
            "query_range", query=expr, start=end - seconds, end=end, step=step
        )["result"]
        return result
