"""The Gymnasium adapter stays a package of owned parts: BoltzLabsVecEnv keeps the Gymnasium API
and hands the rest to its parts (the step batch, spaces, send/recv), each a module of its own.

Read from the source with :mod:`inspect` and :mod:`ast`: no pool is started."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import boltzlabs_gym.vector as vector
from boltzlabs_gym.vector import BoltzLabsVecEnv

#: The most methods (properties and private helpers included) BoltzLabsVecEnv may define itself or
#: inherit from the package's own classes; Gymnasium's VectorEnv methods do not count.
MAX_METHODS = 30
MAX_MODULE_LINES = 600


def _own_methods(cls: type) -> list[str]:
    names = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("boltzlabs_gym"):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(body, ast.ClassDef)
        defs = (n for n in body.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        names += [f"{klass.__name__}.{n.name}" for n in defs]
    return names


def test_the_vector_env_keeps_the_gymnasium_api_and_hands_the_rest_to_its_parts():
    methods = _own_methods(BoltzLabsVecEnv)
    assert len(methods) <= MAX_METHODS, f"{len(methods)} methods: {methods}"
    # Its parts are reached by name, never by forwarding unknown attributes to them.
    assert not any(m.endswith(".__getattr__") or m.endswith(".__getattribute__") for m in methods), methods


def test_no_module_of_the_vector_package_is_over_the_limit():
    lengths = {p.name: len(p.read_text().splitlines()) for p in Path(vector.__file__).parent.glob("*.py")}
    assert {name for name, n in lengths.items() if n > MAX_MODULE_LINES} == set(), lengths
