"""Start-up failures that keep the type of what the env factory raised, where that is safe.

A sandbox whose factory raised reports the exception's class names, most derived first
(:mod:`boltzlabs_gym.wire.start_failure`); nothing of it is unpickled. The first of those
names that is a known class, a builtin exception or one of ``gymnasium.error``'s, gives
the :class:`~boltzlabs_gym.errors.EnvStartError` the trainer raises a second base, so both
``except gymnasium.error.DeprecatedEnv`` and ``except EnvStartError`` catch it, as code
written for ``DummyVecEnv`` (where the factory's exception propagates) expects:

>>> exc = start_error("env 0 failed to start: ...", index=0, types=["gymnasium.error.DeprecatedEnv"])
>>> import gymnasium
>>> isinstance(exc, gymnasium.error.DeprecatedEnv), isinstance(exc, EnvStartError), exc.index
(True, True, 0)
>>> type(exc).__name__
'EnvStartError[DeprecatedEnv]'

A user-defined class is matched by its nearest known base (``class LevelMissing(KeyError)``
raises an ``EnvStartError[KeyError]``); names that are unknown, classes that cannot be
combined with ``EnvStartError`` and those that would change control flow (``StopIteration``,
exception groups, anything not an ``Exception``) leave a plain ``EnvStartError``.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Sequence
from typing import Any

from ..errors import EnvStartError

__all__ = ["start_error"]

#: Builtins left out: raising them in the trainer would change control flow, not report a failure.
_NEVER = frozenset({"StopIteration", "StopAsyncIteration", "ExceptionGroup", "BaseExceptionGroup"})


def start_error(
    message: str,
    index: int | None = None,
    stderr_tail: str = "",
    worker: str | None = None,
    types: Sequence[str] | None = None,
) -> EnvStartError:
    """The :class:`EnvStartError` for a failed start, also an instance of the first known class
    among ``types`` (qualified names, most derived first) when there is one."""
    cls = _typed(tuple(t for t in types or () if isinstance(t, str)))
    return cls(message, index, stderr_tail, worker)


def _typed(types: tuple[str, ...]) -> type[EnvStartError]:
    known = _known_classes()
    for name in types:
        base = known.get(name)
        if base is None:
            continue
        if issubclass(EnvStartError, base):  # RuntimeError, Exception: it is one already
            return EnvStartError
        if base not in _COMBINED:
            _COMBINED[base] = _combined(base)
        cls = _COMBINED[base]
        if cls is not None:
            return cls
    return EnvStartError


@functools.cache
def _known_classes() -> dict[str, type[Exception]]:
    """Qualified name -> class: the builtin exceptions and ``gymnasium.error``'s."""
    known: dict[str, type[Exception]] = {}
    for name, obj in vars(builtins).items():
        if isinstance(obj, type) and issubclass(obj, Exception) and name not in _NEVER:
            known[f"builtins.{name}"] = obj
    try:
        from gymnasium import error as gym_error
    except ImportError:  # pragma: no cover - Gymnasium is a dependency
        return known
    for name, obj in vars(gym_error).items():
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == gym_error.__name__:
            known[f"{gym_error.__name__}.{name}"] = obj
    return known


#: One combined class per base (``None``: that base cannot be combined), made on first use.
_COMBINED: dict[type, type[EnvStartError] | None] = {}


def _combined(base: type[Exception]) -> type[EnvStartError] | None:
    """``EnvStartError`` with ``base`` as a second base, or ``None`` where
    the two cannot be combined or the result does not behave (checked once, on an instance)."""
    name = f"EnvStartError[{base.__name__}]"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"An env failed to start because its factory raised {base.__module__}.{base.__qualname__}.",
        # The message as given: some bases print theirs otherwise (KeyError quotes it, OSError adds errno).
        "__str__": BaseException.__str__,
        "__reduce__": _reduce,
    }
    try:
        cls = type(name, (EnvStartError, base), namespace)
        probe = cls("probe", 0, "", None)
        if str(probe) != "probe" or not isinstance(probe, base):
            return None
    except Exception:  # noqa: BLE001 - a layout conflict, a base whose constructor wants more
        return None
    return cls


def _reduce(self: EnvStartError) -> tuple[Any, tuple]:
    """Pickles as the call that rebuilds it (the class itself is made at run time)."""
    base = type(self).__bases__[-1]  # the second base of a combined class
    names = [f"{base.__module__}.{base.__qualname__}"]
    message = self.args[0] if self.args else ""
    return start_error, (message, self.index, self.stderr_tail, self.worker, names)
