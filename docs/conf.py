"""Sphinx configuration of the celery-zdelay documentation.

Build it with warnings as errors, as ``make docs`` and ``tox -e docs`` do::

    sphinx-build -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import celery_zdelay

project = "celery-zdelay"
author = "celery-zdelay developers"
copyright = "celery-zdelay developers"
release = celery_zdelay.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# docs/examples holds code the pages include, not pages.
exclude_patterns = ["_build", "examples"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"celery-zdelay {release}"


# napoleon reads the first line of an attribute's docstring as "type: text",
# which mangles plain sentences such as the signals' "Sender: the companion".
# The package documents attributes in prose, so their docstrings are kept as
# written: saved before napoleon runs, put back after.
_ATTRIBUTE_KINDS = {"attribute", "data", "property"}
_saved: dict[str, list[str]] = {}


def _save_attribute_doc(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    if what in _ATTRIBUTE_KINDS:
        _saved[name] = list(lines)


def _restore_attribute_doc(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    if what in _ATTRIBUTE_KINDS and name in _saved:
        lines[:] = _saved.pop(name)


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("autodoc-process-docstring", _save_attribute_doc, priority=100)
    app.connect("autodoc-process-docstring", _restore_attribute_doc, priority=900)
