"""The package's import graph: no circles, and no private names across modules.

Read from the source with :mod:`ast`, without importing anything. Two rules
(STYLE.md 1 and 16, httpx's "private modules, public names inside them"):

- no import circle: a module's imports never lead back to it, counting
  those inside functions and methods too (an import deferred into a
  function is a circle all the same, only one that fails later and hides
  from the reader); only ``if TYPE_CHECKING:`` blocks are left out, as they
  never run. Importing a submodule also runs its package's ``__init__``;
  that implicit step is not counted, or every package that re-exports its
  modules would be a circle;
- no underscore name imported from another module of the package (a module
  whose own name starts with an underscore is fine: it is the names inside
  that must be public once another module uses them), beyond
  :data:`ALLOWED_PRIVATE_IMPORTS`.

And one rule of the data's path (STYLE.md 2 and 23): the store
(``celery_zdelay.store``) imports nothing from the producer side, nor from
the worker, the companion or the CLI: only the foundations in
:data:`STORE_FOUNDATIONS`, whose own imports stay among them.

The last tests check the checker on a package written for them, so a
circle added to ``celery_zdelay`` cannot slip through a checker that broke.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import celery_zdelay

pytestmark = pytest.mark.timeout(30)

PACKAGE = "celery_zdelay"
# The package under test: the checkout's, or the installed wheel's when the
# tests run from a copy without it (tox, ZDELAY_TEST_INSTALLED).
ROOT = Path(celery_zdelay.__file__).resolve().parent.parent

#: (importing module, imported module, name): the underscore names still
#: imported across modules. Keep it short; each entry says why it stays.
ALLOWED_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()

#: What the store may import from the rest of the package: data formats,
#: settings and errors that producer, companion and worker share. Adding a
#: module here says it belongs below the store.
STORE_FOUNDATIONS = frozenset(
    f"{PACKAGE}.{name}"
    for name in (
        "_format",  # times and sizes in messages
        "bulk_limit",  # how many entries one script call may take
        "concurrency",  # concurrency control values, read by config
        "config",  # the settings
        "due_score",  # the due set's score
        "entry",  # the parked entry's bytes
        "errors",
        "rates",  # rate limit values, read by config and the control keys
        "schedule",  # Due, a due time
        "stale",  # max_late values, read by config
    )
)

Modules = dict[str, tuple[Path, bool]]


def modules(root: Path, package: str) -> Modules:
    """Return module name -> (file, is a package) for every module of *package* under *root*."""
    found: Modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """Return the module a ``from ... import`` names, its dots resolved against *module*."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Yield every import under *node* that can run: in functions too, not in type checks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from _imports(ast.Module(body=child.orelse, type_ignores=[]))
        else:
            yield from _imports(child)


def _targets(found: Modules, module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules of the package an import statement of *module* imports."""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:
        source = _absolute(module, found[module][1], node)
        submodules = {f"{source}.{alias.name}" for alias in node.names} & found.keys()
        # "from . import views" imports the submodule; any other name comes from the module.
        names = submodules | ({source} if len(submodules) < len(node.names) else set())
    return {name for name in names if name in found and name != module}


def import_graph(found: Modules) -> dict[str, set[str]]:
    """Return module -> the modules of the package its imports (in functions too) import."""
    graph: dict[str, set[str]] = {}
    for module, (path, _) in found.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = set()
        for node in _imports(tree):
            graph[module] |= _targets(found, module, node)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return one circle (a -> b -> ... -> a) per group of modules that import each other."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                found.append([*path[path.index(imported) :], imported])
            elif imported not in state:
                visit(imported)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def private_imports(found: Modules) -> set[tuple[str, str, str]]:
    """Return (importer, module, name) for each underscore name imported from another module.

    Every import counts here, inside functions and type checks too.
    """
    imports = set()
    for module, (path, is_package) in found.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _absolute(module, is_package, node)
            if source not in found:
                continue
            for alias in node.names:
                name = alias.name
                private = name.startswith("_") and not name.startswith("__")
                if private and f"{source}.{name}" not in found:
                    imports.add((module, source, name))
    return imports


def test_no_module_imports_itself_through_others() -> None:
    # Given the imports of every module of the package, inside functions too
    graph = import_graph(modules(ROOT, PACKAGE))

    # Then none leads back to where it started
    assert circles(graph) == [], "import circles: " + "; ".join(
        " -> ".join(circle) for circle in circles(graph)
    )


def every_import(found: Modules, module: str) -> set[str]:
    """The modules of the package *module* imports anywhere, type checks included."""
    path, _ = found[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return {
        target
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for target in _targets(found, module, node)
    }


def test_the_store_imports_only_the_store_and_its_foundations() -> None:
    # Given every module of the store, and the foundations it may use
    found = modules(ROOT, PACKAGE)
    graph = import_graph(found)
    store = {module for module in found if module.split(".")[:2] == [PACKAGE, "store"]}
    allowed = STORE_FOUNDATIONS | store

    # Then the store's imports (for type checks too) stay among them,
    # and so do the foundations' own
    outside = {
        (module, imported)
        for module in allowed
        for imported in (every_import(found, module) if module in store else graph[module])
        if imported not in allowed
    }
    assert outside == set(), f"the store reaches the rest of the package: {sorted(outside)}"


def test_no_private_name_is_imported_from_another_module() -> None:
    # Given every "from ... import _name" between modules of the package
    found = private_imports(modules(ROOT, PACKAGE))

    # Then each is on the allow-list, and the allow-list names none that is gone
    assert found - ALLOWED_PRIVATE_IMPORTS == set(), (
        "make these names public in their module (or import a public one): "
        f"{sorted(found - ALLOWED_PRIVATE_IMPORTS)}"
    )
    assert ALLOWED_PRIVATE_IMPORTS - found == set(), "remove from ALLOWED_PRIVATE_IMPORTS"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_circle_and_only_a_real_one(tmp_path: Path) -> None:
    # Given a package where a imports b and b imports a (through "from . import"),
    # while d imports a only for type checking (its else branch imports f, which
    # imports nothing back), and a package's __init__ imports its own submodule
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from . import a\n",
            "pkg/a.py": "from .b import thing\nfrom . import d\n",
            "pkg/b.py": "from . import a\nthing = 1\n",
            "pkg/d.py": (
                "import typing\nif typing.TYPE_CHECKING:\n    from .a import x\n"
                "else:\n    from .f import z\n"
            ),
            "pkg/f.py": "z = 1\n",
            "pkg/sub/__init__.py": "from .e import y\n",
            "pkg/sub/e.py": "from .. import a\ny = 1\n",
        },
    )

    # When its graph is read
    graph = import_graph(modules(tmp_path, "pkg"))

    # Then the one circle is a <-> b; the type-only import is no circle, its else is read
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert graph["pkg.d"] == {"pkg.f"}


def test_the_checker_finds_a_circle_made_only_by_an_import_inside_a_function(
    tmp_path: Path,
) -> None:
    # Given a package where a imports b at its top, and b imports a only inside
    # a method of a class, within a try block, as a deferred import hides a circle
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .b import B\n",
            "pkg/b.py": (
                "class B:\n"
                "    def later(self):\n"
                "        try:\n"
                "            from .a import x\n"
                "        except ImportError:\n"
                "            pass\n"
            ),
        },
    )

    # When its graph is read
    found = circles(import_graph(modules(tmp_path, "pkg")))

    # Then the circle is found all the same
    assert found == [["pkg.a", "pkg.b", "pkg.a"]]


def test_the_checker_finds_private_names_but_not_private_modules(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/_base.py": "_helper = 1\npublic = 2\n",
            "pkg/user.py": "from ._base import _helper, public\nfrom . import _base\n",
            "pkg/other.py": "def later():\n    from .user import _secret\n",
        },
    )

    found = private_imports(modules(tmp_path, "pkg"))

    assert found == {("pkg.user", "pkg._base", "_helper"), ("pkg.other", "pkg.user", "_secret")}
