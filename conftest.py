"""Doctest collection of the package (pyproject: --doctest-modules): optional parts whose
dependency is not installed are left out, as their tests skip (tests/adapters/test_ray.py)."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("ray") else ["boltzlabs_gym/ray/*"]
