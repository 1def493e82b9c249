"""Every test marked by what it uses: ``unit``, ``store`` or ``system``.

Nobody keeps a list of files per layer: at collection, each test's code is
read (its own function, every fixture it asks for, and every helper of the
test tree those call, followed through their names and through a module's
attributes, as ``django_forks.run``) and the heaviest thing it reaches
names its layer:

* ``system``: a Celery worker or companion process, any subprocess, a
  RabbitMQ broker, a browser, a Redis Cluster;
* ``store``: a real Redis, and nothing of the above;
* ``unit``: no server at all.

``make test-fast`` runs ``-m "not system"``; ``make servers`` runs ``-m store``
on each store server. A test that reaches a process through a path this
reading cannot follow (a name built at run time) would be marked too light:
``tests/test_layers.py`` checks the rule on known cases, and a test can say
``@pytest.mark.system`` itself, which always wins.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator
from typing import Any

import pytest

LAYERS = ("unit", "store", "system")

#: Fixtures that start or reach a whole system: processes, brokers, browsers.
SYSTEM_FIXTURES = frozenset(
    {"worker", "companion", "processes", "cluster", "rabbitmq", "browser", "page", "viewport"}
)
#: Names whose use in a test's code (or a helper it calls) means the same.
SYSTEM_NAMES = frozenset(
    {
        "subprocess",
        "Popen",
        "CeleryProcess",
        "start_worker",
        "start_companion",
        "LocalCluster",
        "sync_playwright",
        "RABBITMQ_URL",
    }
)
#: A real Redis: the session's private server, or one a test starts itself.
STORE_FIXTURES = frozenset({"redis_server"})
STORE_NAMES = frozenset({"RedisServer"})

#: Code of these packages is followed; anything else (Celery, redis-py, the
#: package under test) is a leaf, judged by the name the test used for it.
#: (benchmarks: tests/benchmarks starts workers and servers through it.)
FOLLOWED = ("tests", "example_project", "benchmarks")


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(obj: Any) -> Iterator[types.FunctionType]:
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, types.FunctionType):
        yield obj
    elif isinstance(obj, type):
        for member in vars(obj).values():
            function = member
            if isinstance(function, (staticmethod, classmethod)):
                function = function.__func__
            if isinstance(function, property):
                function = function.fget
            if isinstance(function, types.FunctionType):
                yield function


def reached_names(*roots: Any) -> set[str]:
    """Every global or attribute name the code of *roots* reaches, transitively."""
    names: set[str] = set()
    seen: set[int] = set()
    pending = [func for root in roots for func in _functions(root)]
    while pending:
        func = pending.pop()
        if id(func.__code__) in seen:
            continue
        seen.add(id(func.__code__))
        for code in _codes(func.__code__):
            for name in code.co_names:
                names.add(name)
                target = func.__globals__.get(name)
                if isinstance(target, types.ModuleType):
                    # ``helpers.start(...)``: what the code takes from a
                    # module of the test tree is followed as an import of it
                    # would be (the attribute's name is in co_names too).
                    if target.__name__.split(".")[0] in FOLLOWED:
                        for attribute in code.co_names:
                            pending.extend(_followed(getattr(target, attribute, None)))
                    continue
                pending.extend(_followed(target))
    return names


def _followed(target: Any) -> Iterator[types.FunctionType]:
    """The functions of *target* to read on, if it belongs to a followed package."""
    module = getattr(target, "__module__", None) or ""
    if module.split(".")[0] in FOLLOWED:
        yield from _functions(target)


def layer_of(item: pytest.Function) -> str:
    """The layer a collected test belongs to (see the module docstring)."""
    for layer in LAYERS:
        if item.get_closest_marker(layer) is not None:
            return layer
    fixtures = set(item.fixturenames)
    definitions = getattr(item, "_fixtureinfo", None)
    fixture_funcs = [
        fixturedef.func
        for name in fixtures
        for fixturedef in (definitions.name2fixturedefs.get(name, ()) if definitions else ())
    ]
    names = reached_names(item.function, *fixture_funcs)
    if fixtures & SYSTEM_FIXTURES or names & SYSTEM_NAMES:
        return "system"
    if fixtures & STORE_FIXTURES or names & STORE_NAMES:
        return "store"
    return "unit"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "unit: needs no server (marked automatically)")
    config.addinivalue_line("markers", "store: needs a real Redis (marked automatically)")
    config.addinivalue_line(
        "markers",
        "system: starts workers, companions, subprocesses, brokers, browsers or clusters "
        "(marked automatically)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function):
            item.add_marker(layer_of(item))
