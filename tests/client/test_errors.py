"""The exception tree: the drawing in errors.py's docstring is the code's, and every class is where it was."""

from __future__ import annotations

import ast
import builtins
import re

import pytest

from boltzlabs_gym import errors

#: One node of the drawn tree: its depth (in 5-character steps), name and the builtin in brackets.
_NODE = re.compile(r"^ {5}(?P<indent>(?:│ {4}| {5})*)[├└]── (?P<name>\w+) \((?P<builtin>\w+)\)")


def _drawn_tree() -> list[tuple[int, str, str]]:
    nodes = []
    for line in (errors.__doc__ or "").splitlines():
        m = _NODE.match(line)
        if m:
            nodes.append((len(m["indent"]) // 5, m["name"], m["builtin"]))
    return nodes


def test_the_drawing_lists_every_exported_class_once():
    names = [name for _, name, _ in _drawn_tree()]
    assert sorted(names) == sorted(set(errors.__all__) - {"BoltzLabsError"})


@pytest.mark.parametrize("depth,name,builtin", _drawn_tree(), ids=lambda v: str(v))
def test_each_class_subclasses_its_drawn_parent_and_builtin(depth, name, builtin):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.BoltzLabsError)
    assert issubclass(cls, getattr(builtins, builtin)), f"{name} should also be a {builtin}"
    nodes = _drawn_tree()
    i = [n for _, n, _ in nodes].index(name)
    parents = [n for d, n, _ in nodes[:i] if d == depth - 1]
    parent = getattr(errors, parents[-1]) if depth else errors.BoltzLabsError
    assert cls.__bases__[0] is parent


def test_every_exported_class_is_a_boltzlabs_error():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert isinstance(cls, type) and issubclass(cls, errors.BoltzLabsError), name
    assert errors.BoltzLabsError.__bases__ == (Exception,)


def test_errors_imports_nothing_from_the_package():
    """A leaf: the env side (standard library only) and every other module may import it."""
    with open(errors.__file__) as f:
        tree = ast.parse(f.read())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [("__future__", ["annotations"])]


@pytest.mark.parametrize(
    "module,name",
    [
        ("boltzlabs_gym.wire.codec", "CodecError"),
        ("boltzlabs_gym.wire.keys", "KeyFileError"),
        ("boltzlabs_gym.wire.protocol", "ProtocolError"),
        ("boltzlabs_gym.worker.sandbox", "SandboxUnavailable"),
        ("boltzlabs_gym.worker.sandbox.base", "SandboxUnavailable"),
        ("boltzlabs_gym.testing", "NetnsUnavailable"),
        ("boltzlabs_gym", "SandboxUnavailable"),
        ("boltzlabs_gym", "ProtocolError"),
    ],
)
def test_classes_stay_importable_where_they_were_and_are_the_same_object(module, name):
    import importlib

    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_context_attributes():
    exc = errors.EnvStartError("env 3 did not start", index=3, stderr_tail="ImportError", worker="tcp://w:1")
    assert (str(exc), exc.index, exc.stderr_tail, exc.worker) == ("env 3 did not start", 3, "ImportError", "tcp://w:1")
    timeout = errors.WorkerTimeout("no reply", worker="tcp://w:1")
    assert timeout.worker == "tcp://w:1"
    with pytest.raises(TimeoutError):
        raise timeout
    with pytest.raises(errors.WorkerError):
        raise errors.WorkerTimeout("no reply")
