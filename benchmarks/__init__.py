"""celery-zdelay's benchmark suite: ``python -m benchmarks --help``.

Each module measures some of DESIGN §7's targets side by side with what
they are compared to, in one run; :mod:`benchmarks.run` runs them all and
:mod:`benchmarks.report` turns the results into a table, docs and a plot.
"""
