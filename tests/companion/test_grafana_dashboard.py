"""The shipped Grafana dashboard, checked against Grafana's schema and a real companion.

Grafana is neither in Debian nor on PyPI, so no real Grafana runs here.
Instead: the JSON is type-checked against Grafana's published dashboard
schema (the ``Dashboard`` type of the npm package ``@grafana/schema``, by the
TypeScript compiler: unknown keys, wrong types and values outside an enum
are errors). And a dashboard is JSON that Grafana turns into Prometheus
queries: this test does that part with a real Prometheus (Debian's)
scraping a real companion that released tasks. Every panel's query, with
Grafana's variables filled in as Grafana fills them, must parse, evaluate
to series over the last minute (as the panel asks, a range query) with
values, and carry each label its legend shows; the *Job* variable's query must list the scrape job.

Given a companion with ``--metrics-port`` that released tasks, scraped by
Prometheus, each panel of ``docs/grafana-dashboard.json`` shows data. And the
store's gauges stay in Prometheus when one of two companions dies: every
companion reports every shard.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_zdelay.testing import free_port
from tests.conftest import AppFactory
from tests.helpers import ROOT, CeleryProcess, unavailable, wait_for
from tests.support.prometheus import Prometheus, prometheus_binary

pytestmark = pytest.mark.timeout(150)

DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
JOB = "zdelay"
#: Grafana's ``$__rate_interval`` is at least four scrape intervals; a wider
#: window than that keeps a loaded machine's missed scrapes from emptying it.
RATE_INTERVAL = "30s"


#: The pinned schema package and compiler (package.json, package-lock.json).
SCHEMA_PACKAGE = ROOT / "tests" / "grafana_schema"
#: The classic (v1) dashboard JSON's types inside @grafana/schema.
SCHEMA_TYPES = "node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts"


@pytest.fixture(scope="module")
def schema_checker(tmp_path_factory: pytest.TempPathFactory) -> Callable[[dict[str, Any]], str]:
    """A function that type-checks a dashboard against Grafana's schema; returns tsc's errors."""
    npm = shutil.which("npm")
    if npm is None:
        unavailable(
            "npm is not installed", in_ci="npm is required in CI for the Grafana schema check"
        )
    folder = tmp_path_factory.mktemp("grafana-schema")
    for name in ("package.json", "package-lock.json"):
        shutil.copy(SCHEMA_PACKAGE / name, folder / name)
    subprocess.run(
        [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
        cwd=folder,
        check=True,
        capture_output=True,
        timeout=240,
    )
    (folder / "dashboard.d.ts").write_text(_json_enums((folder / SCHEMA_TYPES).read_text()))

    def check(dashboard: dict[str, Any]) -> str:
        (folder / "check.ts").write_text(
            "import type { Dashboard } from './dashboard';\n"
            f"export const dashboard: Dashboard = {json.dumps(dashboard, indent=1)};\n"
        )
        done = subprocess.run(
            [str(folder / "node_modules/.bin/tsc"), "--noEmit", "--strict", "check.ts"],
            check=False,
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return "" if done.returncode == 0 else done.stdout + done.stderr

    return check


def _json_enums(types: str) -> str:
    """The schema's TypeScript enums as unions of their values, which is what JSON holds.

    A TypeScript enum accepts only its own members, never the literal string
    or number a JSON file has; the values each enum allows are unchanged.
    """
    enums: dict[str, dict[str, str]] = {}

    def as_union(match: re.Match[str]) -> str:
        members = dict(re.findall(r'(\w+)\s*=\s*("[^"]*"|-?\d+)', match.group(2)))
        enums[match.group(1)] = members
        return f"export type {match.group(1)} = {' | '.join(members.values())};"

    text = re.sub(r"export declare enum (\w+) \{([^}]*)\}", as_union, types)
    assert enums, "no enum found: has @grafana/schema's layout changed?"
    for name, members in enums.items():
        for member, value in members.items():
            text = re.sub(rf"\b{name}\.{member}\b", value, text)
    return text


def test_the_dashboard_matches_grafanas_published_schema(
    schema_checker: Callable[[dict[str, Any]], str],
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert schema_checker(dashboard) == ""


@pytest.mark.parametrize(
    ("where", "change", "error"),
    [
        ("a misspelt panel key", lambda d: d["panels"][1].update(gridpos={}), "gridpos"),
        (
            "a value outside an enum",
            lambda d: d["panels"][1]["fieldConfig"]["defaults"]["thresholds"].update(
                mode="absolut"
            ),
            "ThresholdsMode",
        ),
        ("a wrong type", lambda d: d.update(schemaVersion="39"), "number"),
        ("a variable without its type", lambda d: d["templating"]["list"][1].pop("type"), "type"),
    ],
)
def test_the_schema_check_refuses_what_grafana_would_not_read(
    schema_checker: Callable[[dict[str, Any]], str],
    where: str,
    change: Callable[[dict[str, Any]], Any],
    error: str,
) -> None:
    # The check above would pass vacuously if the checker accepted anything.
    dashboard = json.loads(DASHBOARD.read_text())
    change(dashboard)
    assert error in schema_checker(dashboard), where


def _targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (panel["title"], target)
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def _as_grafana_sends(expr: str) -> str:
    """*expr* with the dashboard's variables filled in, as Grafana sends it."""
    # $job is a multi-value variable used in =~: Grafana sends the chosen
    # values as a regex alternation.
    return expr.replace("$job", JOB).replace("$__rate_interval", RATE_INTERVAL)


def _metrics_port(companion: Callable[..., CeleryProcess], app: Celery, *args: str) -> int:
    port = free_port()
    process = companion(app, *args, "--metrics-port", str(port))
    process.wait_for_log(f"Serving Prometheus metrics on 127.0.0.1:{port}/metrics")
    return port


def test_every_panel_of_the_dashboard_shows_what_a_companion_exports(
    make_test_app: AppFactory, companion: Callable[..., CeleryProcess]
) -> None:
    prometheus_binary()
    dashboard = json.loads(DASHBOARD.read_text())
    targets = _targets(dashboard)
    assert len(targets) >= 15  # the test reads the panels it means to check

    app = make_test_app(conf={"zdelay_shards": 2})
    port = _metrics_port(companion, app)
    with Prometheus([f"127.0.0.1:{port}"], job=JOB) as prometheus:
        wait_for(
            lambda: prometheus.query(f'up{{job="{JOB}"}} == 1'),
            timeout=30,
            message="Prometheus scraping the companion",
        )
        # When tasks are released while Prometheus watches
        record = app.tasks["tests.record"]
        for n in range(6):
            record.apply_delayed((n,), countdown=0)
        record.apply_delayed(("later",), countdown=3600)
        wait_for(
            lambda: prometheus.query(f'sum(zdelay_released_total{{job="{JOB}"}}) == 6'),
            timeout=60,
            message="6 releases in Prometheus",
        )
        # ... and a scrape after them, so each rate window holds the increase
        wait_for(
            lambda: prometheus.query(
                f'count_over_time(zdelay_released_total{{job="{JOB}",path="handoff"}}[5s]) >= 3'
            ),
            timeout=30,
            message="scrapes after the releases",
        )

        # Then the Job variable lists the scrape job
        variable = dashboard["templating"]["list"][1]
        match = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"])
        assert match is not None, variable["query"]
        metric, label = match.groups()
        assert JOB in prometheus.api(f"label/{label}/values", **{"match[]": metric})

        # And every panel's query parses, evaluates to series with values,
        # and carries the labels its legend shows
        empty = []
        for title, target in targets:
            expr = _as_grafana_sends(target["expr"])
            series = prometheus.query_range(expr, seconds=60, step=1)
            values = [float(v) for s in series for _, v in s["values"]]
            if not series or not any(math.isfinite(v) for v in values):
                empty.append(f"{title}: {expr}")
                continue
            for label in re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")):
                assert all(label in s["metric"] for s in series), (title, label, series)
        assert empty == [], "panels with no data:\n" + "\n".join(empty)

        # And the stat panels show the store's counts
        parked = prometheus.query(_as_grafana_sends(targets[0][1]["expr"]))
        assert targets[0][0] == "Parked"
        assert [float(v) for _, v in (s["value"] for s in parked)] == [1.0]


def test_store_gauges_outlive_the_companion_that_served_them(
    make_test_app: AppFactory, companion: Callable[..., CeleryProcess]
) -> None:
    # Breaks if: a companion's gauges covered only its own shards (then the
    # survivor, releasing shard 1 only, would not report shard 0).
    prometheus_binary()
    app = make_test_app(conf={"zdelay_shards": 2})
    record = app.tasks["tests.record"]
    for n in range(4):
        record.apply_delayed((n,), countdown=3600)
    first = free_port()
    dying = companion(app, "--shards", "0", "--metrics-port", str(first))
    dying.wait_for_log(f"Serving Prometheus metrics on 127.0.0.1:{first}/metrics")
    second = _metrics_port(companion, app, "--shards", "1")
    parked = f'sum(max by (shard) (zdelay_parked_tasks{{job="{JOB}"}}))'
    with Prometheus([f"127.0.0.1:{first}", f"127.0.0.1:{second}"], job=JOB) as prometheus:
        wait_for(
            lambda: len(prometheus.query(f'up{{job="{JOB}"}} == 1')) == 2,
            timeout=30,
            message="both companions scraped",
        )
        # When the first companion dies without a word
        dying.kill()
        wait_for(
            lambda: len(prometheus.query(f'up{{job="{JOB}"}} == 0')) == 1,
            timeout=30,
            message="Prometheus seeing the first companion down",
        )
        # Then the dashboard's query still counts every shard's parked tasks,
        # from the one left, and reports both shards
        wait_for(
            lambda: _single(prometheus.query(parked)) == 4.0,
            timeout=30,
            message="4 parked tasks from the surviving companion",
        )
        shards = prometheus.query(
            f'zdelay_parked_tasks{{job="{JOB}",instance="127.0.0.1:{second}"}}'
        )
        assert sorted(s["metric"]["shard"] for s in shards) == ["0", "1"]


def _single(vector: list[dict[str, Any]]) -> float | None:
    return float(vector[0]["value"][1]) if len(vector) == 1 else None
