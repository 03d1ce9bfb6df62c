"""Doctest collection of the package (pyproject: --doctest-modules): optional parts whose
dependency is not installed are left out, as their tests skip (tests/adapters/test_ray.py).
The code runner's env directory is a program a worker runs (importing it starts serving)."""

import importlib.util

collect_ignore_glob = ["boltzlabs_gym/code/runner_env/*"]
if not importlib.util.find_spec("ray"):
    collect_ignore_glob.append("boltzlabs_gym/ray/*")
if not importlib.util.find_spec("fastapi"):
    collect_ignore_glob.append("boltzlabs_gym/server/*")
