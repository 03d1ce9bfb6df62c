"""Envs built once in the boltz template and inherited, copy-on-write, by every env forked from it.

A boltz template (``mode="boltz"``, a factory env directory) imports the env's modules and warms
them up; without this module every forked env then builds its own env from the factory. For an
Atari env that costs as much as a reset: ale-py's ``AtariEnv.__init__`` loads the ROM, and
``ALEInterface.loadROM`` spends most of its ~170 ms rebuilding the emulator and its colour
tables; the wrappers' set-up and ``gym.make``'s checks run again too, and every page they touch
becomes the env's own. Here the template builds one env per distinct factory (up to
:data:`LIMIT`) and keeps it, never reset; the forked env whose factory it is takes that env
(:func:`build_env`) instead of calling the factory.

What makes that safe, one env never seeing another's state:

* after the fork each env has its own copy of every page (copy-on-write): a step or reset in
  one env writes its own pages, never the template's or a sibling's;
* an env built from scratch draws its random streams from OS entropy; an inherited one would
  carry the template's. :func:`take` gives it fresh ones before it serves: every Gymnasium
  generator in the env's layers and spaces is dropped (Gymnasium makes a new one, from OS
  entropy, at first use, as for a new env), and ale-py's ``AtariEnv`` seeds its emulator
  again before its first use: a seeded reset seeds it and reloads the ROM anyway; a first
  ``reset()`` without a seed, or a ``step`` before any reset, first draws a seed from OS
  entropy and reloads the ROM with it, as construction did;
* only envs known to keep no other random state are inherited: every layer's class must come
  from Gymnasium or ale-py (:data:`KNOWN_MODULES`), none may hold a generator outside
  ``_np_random``, building may open no file descriptor and start no thread (a fork's inherited
  descriptors are pointed at ``/dev/null``; a fork keeps one thread), and the factory may not
  read what differs between envs (a ``BOLTZLABS_`` environment variable, ``ENV_INDEX``,
  ``ENV_DIR``, ``WORKSPACE``: the template has its own values). Anything else is closed in the
  template and built in each fork, as before.

Standard library only (the env is inspected by duck typing): it runs in the template, before the
fork loop, and in each forked env, before it serves.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any

from . import process_setup

__all__ = ["LIMIT", "KNOWN_MODULES", "build", "take", "build_env", "inheritable"]

#: At most this many distinct factories get an env built in the template (each is built serially
#: there, before any env forks; a pool of many distinct factories builds the rest in its forks).
LIMIT = 4
#: Module prefixes of the classes an inherited env may be made of: envs and wrappers whose only
#: random state is Gymnasium's ``np_random`` (and, for ale-py's ``AtariEnv``, the emulator's seed).
KNOWN_MODULES = ("gymnasium.", "ale_py.")
_MAX_LAYERS = 64

#: (factory, env) built in this template; a forked env takes its own copy's entry (see :func:`take`).
_held: list[tuple[Any, Any]] = []


def _layers(env: Any) -> list[Any]:
    """``env``, the env it wraps, and so on down to the unwrapped env."""
    out = [env]
    while len(out) < _MAX_LAYERS:
        inner = vars(out[-1]).get("env") if hasattr(out[-1], "__dict__") else None
        if inner is None or any(inner is x for x in out):
            break
        out.append(inner)
    return out


def _rng(value: Any) -> bool:
    cls = type(value)
    if cls.__module__.startswith("numpy.random") and cls.__name__ in ("Generator", "RandomState"):
        return True
    return isinstance(value, random.Random)


def _spaces(value: Any) -> list[Any]:
    """The Gymnasium spaces in ``value`` (a space, and those of a Dict/Tuple space, recursively)."""
    if not type(value).__module__.startswith("gymnasium.spaces"):
        return []
    out = [value]
    inner = getattr(value, "spaces", None)
    for sub in inner.values() if isinstance(inner, dict) else inner if isinstance(inner, tuple) else ():
        out.extend(_spaces(sub))
    return out


def _atari(env: Any) -> bool:
    cls = type(env)
    return cls.__module__ == "ale_py.env" and cls.__name__ == "AtariEnv"


def inheritable(env: Any) -> bool:
    """Whether ``env`` is made only of known classes holding no random state but ``_np_random``
    (their spaces' included), so that :func:`take` can give a fork of it fresh streams."""
    layers = _layers(env)
    if hasattr(layers[-1], "env"):
        return False  # deeper than _MAX_LAYERS, or a cycle
    for layer in layers:
        if not type(layer).__module__.startswith(KNOWN_MODULES):
            return False
        for key, value in vars(layer).items():
            if key != "_np_random" and _rng(value):
                return False
            if isinstance(value, (list, tuple, dict)):
                items = value.values() if isinstance(value, dict) else value
                if any(_rng(v) for v in items):
                    return False
    unwrapped = layers[-1]
    # an ale-py env other than AtariEnv (say, its vector env) is not known to take a fresh seed
    return not type(unwrapped).__module__.startswith("ale_py.") or _atari(unwrapped)


def _open_fds() -> set[int]:
    try:
        return {int(x) for x in os.listdir("/proc/self/fd")}
    except OSError:
        return set()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def build(factories: Sequence[Callable[[], Any]] | Callable[[], Any]) -> int:
    """In the template, after the warm-up: build and keep one env per distinct factory (up to
    :data:`LIMIT`) that is :func:`inheritable` and opened no descriptor and started no thread
    while being built; others are closed. Returns how many are held."""
    seen: list[Any] = []
    for factory in factories if isinstance(factories, (list, tuple)) else [factories]:
        if len(seen) >= LIMIT:
            break
        if not callable(factory) or any(factory is f for f in seen):
            continue
        seen.append(factory)
        fds, threads = _open_fds(), _threads()
        try:
            with _watch_per_env() as used:
                env = factory()
        except Exception:  # noqa: BLE001 - left to fail, and say why, in the fork that builds it
            continue
        if not used and inheritable(env) and not (_open_fds() - fds) and _threads() <= threads:
            _held.append((factory, env))
            continue
        try:
            env.close()
        except Exception:  # noqa: BLE001
            pass
    return len(_held)


class _WatchedEnviron(MutableMapping):
    """``os.environ`` while a factory builds in the template: notes a read of any ``BOLTZLABS_``
    variable (the env's index, workspace, ...: the template's values, not a fork's) or of all of them."""

    def __init__(self, real: Any, used: list[str]):
        self._real, self._used = real, used

    def _note(self, key: Any) -> None:
        if isinstance(key, str) and key.startswith("BOLTZLABS_"):
            self._used.append(key)

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return self._real[key]

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return key in self._real

    def __setitem__(self, key: Any, value: Any) -> None:
        self._real[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._real[key]

    def __iter__(self) -> Iterator[Any]:
        self._used.append("*")
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)

    def copy(self) -> dict:
        self._used.append("*")
        return dict(self._real)


def _watched(value: Any, used: list[str]) -> Any:
    """A copy of ``ENV_INDEX``/``ENV_DIR``/``WORKSPACE`` (an int or str subclass) that notes any use."""
    plain = int(value) if isinstance(value, int) else str(value)
    base = type(plain)
    skip = {"__new__", "__init__", "__getattribute__", "__setattr__", "__delattr__", "__init_subclass__"}
    skip |= {"__subclasshook__", "__class__", "__getnewargs__", "__reduce__", "__reduce_ex__", "__sizeof__"}

    def noting(name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            used.append(name)
            return getattr(plain, name)(*args, **kwargs)

        return method

    names = [n for n in dir(base) if n not in skip and callable(getattr(base, n))]
    return type("Watched" + type(value).__name__, (type(value),), {n: noting(n) for n in names})(plain)


@contextmanager
def _watch_per_env() -> Iterator[list[str]]:
    """While a factory builds in the template: note whether it reads what differs between envs, the
    ``BOLTZLABS_`` environment variables or ``ENV_INDEX``/``ENV_DIR``/``WORKSPACE`` (every module
    global bound to them, as the fork loop rebinds them in each fork). Such an env is not inherited."""
    used: list[str] = []
    per_env = {id(v): v for v in (process_setup.ENV_INDEX, process_setup.ENV_DIR, process_setup.WORKSPACE)}
    watched = {key: _watched(v, used) for key, v in per_env.items()}
    bound: list[tuple[dict, str, Any]] = []
    for module in list(sys.modules.values()):
        d = getattr(module, "__dict__", None)
        if isinstance(d, dict):
            bound.extend((d, k, v) for k, v in list(d.items()) if id(v) in per_env and v is per_env[id(v)])
    real_environ = os.environ
    try:
        for d, k, v in bound:
            d[k] = watched[id(v)]
        # (os.getenv reads it too; the process environment itself is untouched: nothing to clear)
        os.environ = _WatchedEnviron(real_environ, used)  # type: ignore[assignment]  # noqa: B003
        yield used
    finally:
        os.environ = real_environ  # noqa: B003
        for d, k, v in bound:
            d[k] = v


def take(factory: Any) -> Any:
    """In a forked env: the env the template built for ``factory`` (once; None if there is none),
    given fresh random streams."""
    for i, (held_factory, env) in enumerate(_held):
        if held_factory is factory:
            del _held[i]
            _fresh_streams(env)
            return env
    return None


def build_env(factory: Callable[[], Any]) -> Any:
    """The env a forked env serves for ``factory``: the template's, inherited (:func:`take`), else ``factory()``."""
    env = take(factory)
    return factory() if env is None else env


def _fresh_streams(env: Any) -> None:
    """Drop every Gymnasium generator of ``env`` (made again from OS entropy at first use, as in a
    new env); an ale-py ``AtariEnv`` also seeds its emulator afresh before first use (:func:`_fresh_atari`)."""
    for layer in _layers(env):
        d = vars(layer)
        if d.get("_np_random") is not None:
            d["_np_random"] = None
            if "_np_random_seed" in d:
                d["_np_random_seed"] = None
        for value in list(d.values()):
            for space in _spaces(value):
                sd = vars(space)
                if "_np_random" in sd:
                    sd["_np_random"] = None
    unwrapped = _layers(env)[-1]
    if _atari(unwrapped):
        _fresh_atari(unwrapped)


def _fresh_atari(env: Any) -> None:
    """``env``'s generator is dropped (see :func:`_fresh_streams`); its emulator's seed is drawn when
    first needed: a seeded reset draws both from its seed and loads the ROM anyway; a first reset
    without a seed, or a step before any reset, first draws a new seed from OS entropy and loads
    the ROM with it (``seed_game()``, ``load_game()``: what ``AtariEnv.__init__`` did), then the
    instance's own ``reset``/``step`` are the class's again."""
    cls = type(env)

    def first(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            vars(env).pop("reset", None)
            vars(env).pop("step", None)
            if name == "step" or kwargs.get("seed") is None:
                env.seed_game()
                env.load_game()
            return getattr(cls, name)(env, *args, **kwargs)

        return call

    env.reset = first("reset")
    env.step = first("step")
