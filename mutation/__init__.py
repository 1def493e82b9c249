"""Mutation testing of the modules and Lua scripts that guard a promise (``make mutants``).

Python modules are mutated by cosmic-ray (``python_mutants``); the Lua
scripts by this package's own mutator (``lua_mutants``). Each mutant runs
only the tests that cover its file (``targets``), in a scratch copy of the
tree (``tree``), and the run ends in one report (``report``): see
docs/mutation.rst.
"""
