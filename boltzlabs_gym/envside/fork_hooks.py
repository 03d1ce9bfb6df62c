"""Forks of a single-threaded interpreter without the standard library's thread bookkeeping.

``os.fork`` runs every ``os.register_at_fork`` hook in the child. Two of the standard library's
hooks, ``threading._after_fork`` and ``logging._after_at_fork_child_reinit_locks``, exist for a
parent that had other threads: they rebuild the threading module's registry and re-initialise
locks another thread may have held at the fork. Where the parent forks from its only thread, the
child's copy of that state is already right, and the hooks' only effect is their cost: in a
forked child every page they touch (the code, functions and globals they use, the objects whose
reference counts they change) is copied. Measured here (Python 3.11, threading and logging
imported): 240 page faults in the child before its first line without this, 120 with it, about
0.25 ms of CPU per fork on a 2-vCPU VM. The envs, the template that forks them and the code
runner's zygote fork once or more per program, so that is paid on every run.

:func:`suspend` (in a process about to fork from its only thread) makes those two hooks do
nothing; every child calls :func:`restore` first, so that its own forks, after it may have started
threads, run them as usual. ``random``'s hook, which gives the child a fresh random state, and any
other hook are left alone.

Standard library only: it runs in the boltz template, in envs and in the code runner's zygote.
How a forking process uses it (not run as a doctest: it would fork the test process)::

    suspend()  # (False, and nothing changed, where another thread runs)
    pid = os.fork()
    if pid == 0:
        restore()  # first, in the child
        ...
    restore()  # in the parent, before it may start a thread
"""

from __future__ import annotations

import os
import sys
import types

__all__ = ["restore", "single_threaded", "suspend", "suspended"]

#: The hooks suspended: (module, function registered with ``os.register_at_fork(after_in_child=)``).
HOOKS = (("threading", "_after_fork"), ("logging", "_after_at_fork_child_reinit_locks"))

#: The suspended hooks and their own code, to put back.
_saved: list[tuple[types.FunctionType, types.CodeType]] = []


def _skip() -> None:
    """What a suspended hook runs instead of its own code."""


def single_threaded() -> bool:
    """Whether this process has one thread (``/proc/self/task``; elsewhere: one Python thread)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        threading = sys.modules.get("threading")
        return threading is None or threading.active_count() == 1


def suspend() -> bool:
    """Make :data:`HOOKS` do nothing in the children of this process's forks, where it has one
    thread; ``False`` (nothing changed) where it has more. The process must not start a thread
    while they are suspended (:func:`restore` first)."""
    if _saved:
        return True
    if not single_threaded():
        return False
    for module, name in HOOKS:
        hook = getattr(sys.modules.get(module), name, None)
        # (a module not imported yet registered no hook; a function with free variables or arguments
        # is not the one this was written for)
        if isinstance(hook, types.FunctionType) and hook.__closure__ is None and hook.__code__.co_argcount == 0:
            _saved.append((hook, hook.__code__))
            hook.__code__ = _skip.__code__
    return True


def restore() -> None:
    """Give the suspended hooks their own code back: first thing in a child, and in the parent
    before it may start a thread."""
    while _saved:
        hook, code = _saved.pop()
        hook.__code__ = code


def suspended() -> bool:
    """Whether hooks are suspended in this process."""
    return bool(_saved)
