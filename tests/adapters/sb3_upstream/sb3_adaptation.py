"""Adapt one of SB3's vec-env test files by construction only: where it builds ``DummyVecEnv``
or ``SubprocVecEnv``, it builds ``BoltzLabsSB3VecEnv``.

The rewrite works on the syntax tree and edits only the spans of the constructions, so every
other character of upstream's text stays as it is. The places it rewrites:

* a call of either class, ``DummyVecEnv([...])``;
* the class handed to ``functools.partial`` (``partial(SubprocVecEnv, start_method=...)``);
* the class given as ``vec_env_cls=``;
* a list or tuple of those classes only (``VEC_ENV_CLASSES``), which becomes one class:
  the two upstream classes would run each test twice on the same one;
* a ``make_vec_env(...)`` call without ``vec_env_cls``, which SB3 builds on ``DummyVecEnv``:
  it gets ``vec_env_cls=BoltzLabsSB3VecEnv``;

and one line after the module's imports imports the class (and the module's worker fixture)
from ``sb3_swap``. A comparison with either class (``if vec_env_class == DummyVecEnv:``)
builds nothing and stays. Any other use of the two names, an alias of them, or a file that
builds no vec env at all is an :class:`AdaptationError`: a new SB3 release changed its tests
in a way these rules do not know, and running them half adapted would test SB3's classes
under our name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

#: The classes upstream builds.
UPSTREAM_CLASSES = frozenset({"DummyVecEnv", "SubprocVecEnv"})
#: The class the adapted tests build, from ``sb3_swap``.
OURS = "BoltzLabsSB3VecEnv"
#: The line that brings it (and one worker per module) into each adapted module.
IMPORT_LINE = f"from sb3_swap import {OURS}, one_worker_per_module  # boltzlabs: the class these tests build"


class AdaptationError(Exception):
    """Upstream's text no longer matches the adaptation rules (a new SB3 release changed it)."""


@dataclass(frozen=True)
class _Edit:
    """Replace the bytes ``start:end`` of the source with ``text``."""

    start: int
    end: int
    text: str
    line: int


def adapt(source: str, filename: str) -> str:
    """Return ``source`` (an upstream test file) building ``BoltzLabsSB3VecEnv``; raises
    :class:`AdaptationError` where it cannot do that and nothing else."""
    tree = ast.parse(source, filename)
    offsets = _LineOffsets(source)
    _refuse_aliases(tree, filename)
    edits = _construction_edits(source, tree, offsets, filename)
    if not edits:
        raise AdaptationError(
            f"{filename}: no DummyVecEnv/SubprocVecEnv construction and no make_vec_env call found; "
            "upstream changed how it builds its vec envs"
        )
    edits.append(_import_edit(tree, offsets, filename))
    adapted = _apply(source, edits)
    _check_adapted(adapted, filename)
    return adapted


def module_functions(source: str) -> set[str]:
    """The names of the module-level functions of ``source`` (its tests among them)."""
    return {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}


class _LineOffsets:
    """Byte offsets of ``(line, column)`` positions: ``ast`` gives columns in UTF-8 bytes."""

    def __init__(self, source: str):
        self.starts = [0]
        for line in source.encode().splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def start(self, node: ast.AST) -> int:
        return self.starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]


def _upstream_class(node: ast.AST) -> str | None:
    """``DummyVecEnv`` or ``SubprocVecEnv`` if ``node`` names one (``vec_env.SubprocVecEnv`` too)."""
    if isinstance(node, ast.Name) and node.id in UPSTREAM_CLASSES:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in UPSTREAM_CLASSES:
        return node.attr
    return None


def _is_partial(func: ast.AST) -> bool:
    return (isinstance(func, ast.Name) and func.id == "partial") or (
        isinstance(func, ast.Attribute) and func.attr == "partial"
    )


def _is_make_vec_env(func: ast.AST) -> bool:
    return (isinstance(func, ast.Name) and func.id == "make_vec_env") or (
        isinstance(func, ast.Attribute) and func.attr == "make_vec_env"
    )


def _refuse_aliases(tree: ast.Module, filename: str) -> None:
    """``import DummyVecEnv as X`` would hide later constructions from these rules."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in UPSTREAM_CLASSES and alias.asname not in (None, alias.name):
                    raise AdaptationError(
                        f"{filename}:{node.lineno}: imports {alias.name} as {alias.asname}; "
                        "the adaptation rules know only the class names"
                    )


def _construction_edits(source: str, tree: ast.Module, offsets: _LineOffsets, filename: str) -> list[_Edit]:
    """One edit per place that builds an upstream class (or lets ``make_vec_env`` pick one)."""
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    edits: list[_Edit] = []
    whole_lists: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_make_vec_env(node.func):
            edit = _make_vec_env_edit(node, offsets, filename)
            if edit is not None:
                edits.append(edit)
        name = _upstream_class(node)
        if name is None:
            continue
        parent = parents.get(node)
        if isinstance(parent, (ast.List, ast.Tuple)) and all(_upstream_class(e) for e in parent.elts):
            if parent not in whole_lists:
                whole_lists.add(parent)
                text = f"[{OURS}]" if isinstance(parent, ast.List) else f"({OURS},)"
                edits.append(_Edit(offsets.start(parent), offsets.end(parent), text, parent.lineno))
        elif _builds(node, parent):
            edits.append(_Edit(offsets.start(node), offsets.end(node), OURS, node.lineno))
        elif not isinstance(parent, ast.Compare):
            line = ast.get_source_segment(source, parent) if parent is not None else name
            raise AdaptationError(
                f"{filename}:{node.lineno}: {name} is used in a way the adaptation rules do not know "
                f"({type(parent).__name__}: {line!r}); update tests/adapters/sb3_upstream/sb3_adaptation.py"
            )
    return edits


def _builds(node: ast.AST, parent: ast.AST | None) -> bool:
    """Whether ``node`` (an upstream class) is what ``parent`` builds: called, partial'd, or vec_env_cls=."""
    if isinstance(parent, ast.Call):
        return parent.func is node or (_is_partial(parent.func) and bool(parent.args) and parent.args[0] is node)
    return isinstance(parent, ast.keyword) and parent.arg == "vec_env_cls"


def _make_vec_env_edit(call: ast.Call, offsets: _LineOffsets, filename: str) -> _Edit | None:
    """``vec_env_cls=BoltzLabsSB3VecEnv`` after the last argument of a call that leaves it to SB3."""
    if any(keyword.arg == "vec_env_cls" for keyword in call.keywords):
        return None  # the class it names is adapted by _builds (or is the test's parameter)
    # vec_env_cls is make_vec_env's eighth parameter; **kwargs may carry it: neither is known here.
    if len(call.args) >= 8 or any(keyword.arg is None for keyword in call.keywords):
        raise AdaptationError(
            f"{filename}:{call.lineno}: a make_vec_env call whose vec_env_cls is positional or in **kwargs"
        )
    arguments: list[ast.AST] = [*call.args, *call.keywords]
    if not arguments:
        raise AdaptationError(f"{filename}:{call.lineno}: make_vec_env called without arguments")
    last = max(arguments, key=offsets.end)
    at = offsets.end(last)
    return _Edit(at, at, f", vec_env_cls={OURS}", call.lineno)


def _import_edit(tree: ast.Module, offsets: _LineOffsets, filename: str) -> _Edit:
    """The import line, after the last import of the module's leading imports."""
    last_import = None
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            last_import = statement
        elif not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)):
            break  # the module docstring may come first; anything else ends the imports
    if last_import is None:
        raise AdaptationError(f"{filename}: no import statements at the top of the module")
    line_end = offsets.starts[last_import.end_lineno]  # type: ignore[index]
    return _Edit(line_end, line_end, IMPORT_LINE + "\n", last_import.end_lineno or last_import.lineno)


def _apply(source: str, edits: list[_Edit]) -> str:
    data = source.encode()
    edits = sorted(edits, key=lambda edit: (edit.start, edit.end))
    for before, after in zip(edits, edits[1:]):
        if after.start < before.end:
            raise AdaptationError(f"overlapping edits at lines {before.line} and {after.line}")
    for edit in reversed(edits):
        data = data[: edit.start] + edit.text.encode() + data[edit.end :]
    return data.decode()


def _check_adapted(adapted: str, filename: str) -> None:
    """The result parses and builds no upstream class: the rules did what they say."""
    tree = ast.parse(adapted, filename)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(tree):
        if _upstream_class(node) and not isinstance(parents.get(node), ast.Compare):
            raise AdaptationError(f"{filename}:{node.lineno}: still refers to {_upstream_class(node)} after adapting")
        if (
            isinstance(node, ast.Call)
            and _is_make_vec_env(node.func)
            and not any(keyword.arg == "vec_env_cls" for keyword in node.keywords)
        ):
            raise AdaptationError(f"{filename}:{node.lineno}: make_vec_env still builds SB3's default")
