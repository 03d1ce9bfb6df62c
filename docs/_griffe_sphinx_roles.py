"""A griffe extension for the docs build: the package's docstrings, written for Sphinx, read as Markdown.

The docstrings use Google sections (``Args:``, ``Attributes:``) and three things of reST that
Markdown does not know; this rewrites them as the docs are built, leaving the code untouched:

* roles (``:class:`~boltzlabs_gym.RLPool```, ``:meth:`snapshot```) become links to the API
  reference where the target is documented there, and code text where it is not (optional
  cross-references, so ``mkdocs build --strict`` does not fail on a private target);
* ``>>>`` examples become ``pycon`` code blocks (Markdown would read ``>`` as a quote);
* a paragraph ending in ``::`` (a literal block follows) ends in ``:``.

Names that ``boltzlabs_gym`` exports lazily (its ``_LAZY`` table) are linked to the module that
defines them, read from ``boltzlabs_gym/__init__.py`` so that a moved module needs no change here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|exc|data|obj|const):`(~?)([^`<>]+?)(?:\s*<([^`>]+)>)?`")
_FENCE = re.compile(r"^\s*(```|~~~)")
_DOCTEST_FLAG = re.compile(r"\s*# doctest:.*$")


def _lazy_exports() -> dict[str, str]:
    """``boltzlabs_gym.NAME`` -> ``module.NAME`` for the names the package exports lazily."""
    init = Path(__file__).resolve().parent.parent / "boltzlabs_gym" / "__init__.py"
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            table = ast.literal_eval(node.value)
            return {f"boltzlabs_gym.{name}": f"{module}.{name}" for name, module in table.items()}
    return {}


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of a loaded package (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._lazy = _lazy_exports()

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, seen=set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = self._rewrite(obj.docstring.value, obj)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)  # type: ignore[arg-type]

    def _rewrite(self, text: str, obj: griffe.Object) -> str:
        text = _ROLE.sub(lambda m: self._role(m, obj), text)
        return _markdown_blocks(text)

    def _role(self, match: re.Match[str], obj: griffe.Object) -> str:
        _kind, tilde, title, target = match.groups()
        target = (target or title).strip()
        title = title.strip() if match.group(4) else target
        shown = title.lstrip(".").split(".")[-1] if tilde else title.lstrip(".")
        return f'<autoref identifier="{self._resolve(target, obj)}" optional><code>{shown}</code></autoref>'

    def _resolve(self, target: str, obj: griffe.Object) -> str:
        if target in self._lazy:
            return self._lazy[target]
        if target.startswith("."):
            module = obj if obj.is_module else obj.module
            base = module.path if module.is_init_module else module.path.rsplit(".", 1)[0]
            parts = base.split(".")
            depth = len(target) - len(target.lstrip("."))
            parts = parts[: len(parts) - (depth - 1)] if depth > 1 else parts
            return ".".join(parts + [target.lstrip(".")])
        if target.startswith("boltzlabs_gym."):
            return target
        head, _, rest = target.partition(".")
        scope: griffe.Object | None = obj
        while scope is not None:
            try:
                resolved = scope.resolve(head)
            except Exception:  # griffe's NameResolutionError, or an alias it cannot follow
                scope = scope.parent
                continue
            resolved = self._lazy.get(resolved, resolved)
            return f"{resolved}.{rest}" if rest else resolved
        return target


def _markdown_blocks(text: str) -> str:
    """Fence ``>>>`` examples as ``pycon`` and turn a reST ``::`` paragraph end into ``:``."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
            out.append(line)
            i += 1
            continue
        if not in_fence and line.lstrip().startswith(">>>"):
            # At the margin: the docstrings hold examples only in running text or in a reST
            # literal block (indented), never inside a Google section.
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
                block.append(_DOCTEST_FLAG.sub("", lines[i][len(indent) :]))
                i += 1
            out += ["```pycon", *block, "```"]
            continue
        if not in_fence and line.rstrip().endswith("::") and not line.lstrip().startswith(":"):
            stripped = line.rstrip()[:-2].rstrip()
            line = stripped + ":" if stripped and not stripped.endswith(":") else stripped
        out.append(line)
        i += 1
    return "\n".join(out)
