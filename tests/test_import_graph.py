"""The package's import graph: no circles, and no private names across modules.

Read from the source with :mod:`ast`, without importing anything. Two rules
(STYLE.md 1 and 16, httpx's "private modules, public names inside them"):

- no import circle among module-level imports: a module's imports at its
  top level (``if TYPE_CHECKING:`` blocks and imports inside functions
  excluded) never lead back to it. Importing a submodule also runs its
  package's ``__init__``; that implicit step is not counted, or every
  package that re-exports its modules would be a circle;
- no underscore name imported from another module of the package (a module
  whose own name starts with an underscore is fine: it is the names inside
  that must be public once another module uses them), beyond
  :data:`ALLOWED_PRIVATE_IMPORTS`.

The last two tests check the checker on a package written for them, so a
circle added to ``celery_zdelay`` cannot slip through a checker that broke.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "celery_zdelay"

#: (importing module, imported module, name): the underscore names still
#: imported across modules. Keep it short; each entry says why it stays.
ALLOWED_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()

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


def _top_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Yield the imports that run when the module is imported (not in functions or type checks)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _top_level_imports(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _top_level_imports(node.body)


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
    """Return module -> the modules of the package its module-level imports import."""
    graph: dict[str, set[str]] = {}
    for module, (path, _) in found.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = set()
        for node in _top_level_imports(tree.body):
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
    # Given the module-level imports of every module of the package
    graph = import_graph(modules(ROOT, PACKAGE))

    # Then none leads back to where it started
    assert circles(graph) == [], "import circles: " + "; ".join(
        " -> ".join(circle) for circle in circles(graph)
    )


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
    # while c imports a only inside a function and d only for type checking
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from . import a\n",
            "pkg/a.py": "from .b import thing\nfrom . import c\n",
            "pkg/b.py": "from . import a\nthing = 1\n",
            "pkg/c.py": "def later():\n    from .a import x\n",
            "pkg/d.py": "import typing\nif typing.TYPE_CHECKING:\n    from .a import x\n",
            "pkg/sub/__init__.py": "from .e import y\n",
            "pkg/sub/e.py": "from .. import a\ny = 1\n",
        },
    )

    # When its graph is read
    found = circles(import_graph(modules(tmp_path, "pkg")))

    # Then the one circle is a <-> b; the lazy and type-only imports are no circle
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
