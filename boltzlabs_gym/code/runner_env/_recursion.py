"""A program's recursion limit as ``python main.py`` would give it, though it starts deep in the runner.

A program runs below the runner's own frames (the env's serve loop, the zygote's, the calls that
start it: about twenty levels), and CPython counts them against ``sys.getrecursionlimit()``. So
without this a program that recursed 990 levels under ``python main.py`` would fail here with a
``RecursionError``, and a solution's verdict would depend on where it ran.

The interpreter's recursion depth (:func:`depth`) is read at the top of a probe run just as the
program will be, from the same frame (:data:`PROBE`). No count of frames would do: CPython 3.11
counts C-level calls too, and the same ``exec`` of a code object was measured to add one level in
one place and two in another. A zygote
has it read once, by a probe program forked as its programs are, and hides what it finds in
itself (:func:`hide`), so that its programs pay nothing (reading the depth raises an exception,
about 60 copied pages in a forked program); a program forked by an env reads it itself
(:func:`start_at_top_level`). :func:`hide` raises the real limit by the levels below the program
that a fresh interpreter would not have, and replaces ``sys.getrecursionlimit``
and ``sys.setrecursionlimit`` with functions that speak in the program's terms: it reads the
limit it would have had (1000 by default), and a limit it sets gives it as many levels as
``python main.py`` would. Threads the program starts begin at depth 0 under the raised limit,
so they can go that many levels deeper than under ``python main.py``.

Standard library only; runs inside the sandbox, in the forked program.
"""

from __future__ import annotations

import operator
import sys

_real_get = sys.getrecursionlimit
_real_set = sys.setrecursionlimit
#: The levels of the runner below the program's first frame (0: nothing hidden yet).
_hidden = 0
#: Whether this process (a zygote, and every program it forks) has them hidden already.
calibrated = False
_TOO_LOW = "the recursion depth "


def depth() -> int | None:
    """The interpreter's recursion depth in this call (as CPython counts it: frames, and in some
    versions C calls), or None where this interpreter does not say it.

    CPython refuses a limit at or below the current depth and names that depth in its message;
    1 is below any depth a call can have. (No other API gives the depth, and counting frames
    misses what CPython counts besides them.)"""
    try:
        _real_set(1)
    except RecursionError as exc:
        text = str(exc)
        at = text.find(_TOO_LOW)
        if at < 0:
            return None
        digits = text[at + len(_TOO_LOW) :].split(":", 1)[0]
        return int(digits) if digits.isdigit() else None
    return None  # (a limit of 1 was accepted: an interpreter that checks nothing; leave it so)


#: What :func:`depth` reads at the top level of a script run by ``python main.py``, and of a module
#: run by ``python -m`` (CPython 3.10 to 3.13; the runner's tests compare with both)
TOP_OF_SCRIPT, TOP_OF_MODULE = (3, 6) if sys.version_info < (3, 12) else (2, 4)
#: The levels ``runpy.run_module`` puts between its caller and the module's code, beyond an ``exec``
#: of a code object from that caller's frame
RUN_MODULE_LEVELS = 3
#: Run by the caller as it will run the program (``exec(PROBE, probe)``, from the same frame): what
#: ``depth()`` reads at the top of the program, ``probe["depth"]``
PROBE = compile("depth = depth()", "<runner>", "exec")


def probe() -> dict:
    """The globals :data:`PROBE` runs in (and leaves the depth in)."""
    return {"depth": depth}


def hidden_below(probed: dict, top: int = TOP_OF_SCRIPT, levels: int = 0) -> int | None:
    """The levels below a program that a fresh interpreter's top level (``top``:
    :data:`TOP_OF_SCRIPT` or :data:`TOP_OF_MODULE`) would not have. ``probed``: :data:`PROBE`'s
    globals, run from the frame that runs the program, as it will run it; ``levels``: what that
    frame's way of running it adds beyond an ``exec`` (:data:`RUN_MODULE_LEVELS`). None where the
    interpreter does not say its depth."""
    here = probed.get("depth")
    return max(0, here + levels - top) if type(here) is int else None


def hide(levels: int) -> None:
    """Raise the real limit by ``levels`` over the one this process started with, and make
    ``sys.getrecursionlimit``/``sys.setrecursionlimit`` speak in the program's terms. In a zygote,
    once (:meth:`Zygote.adjust`): every program it forks inherits it."""
    global _hidden, calibrated
    _real_set(_real_get() - _hidden + levels)
    _hidden, calibrated = levels, True
    sys.getrecursionlimit = getrecursionlimit
    sys.setrecursionlimit = setrecursionlimit


def start_at_top_level(probed: dict, top: int = TOP_OF_SCRIPT, levels: int = 0) -> None:
    """:func:`hide` the levels :func:`hidden_below` finds: in a program that nothing calibrated
    (forked by an env itself, on the hard-reset path), before its first line."""
    hidden = hidden_below(probed, top, levels)
    if hidden is not None:
        hide(hidden)


def getrecursionlimit() -> int:
    """Return the current value of the recursion limit.

    The recursion limit is the maximum depth of the Python interpreter stack. This limit prevents
    infinite recursion from causing an overflow of the C stack and crashing Python."""
    return _real_get() - _hidden


def setrecursionlimit(limit: int, /) -> None:
    """Set the maximum depth of the Python interpreter stack to n.

    This limit prevents infinite recursion from causing an overflow of the C stack and crashing
    Python. The highest possible limit is platform-dependent."""
    try:
        limit = operator.index(limit)
    except TypeError:
        _real_set(limit)  # (the interpreter's own TypeError, as it words it)
        raise
    if limit < 1:
        _real_set(limit)  # (its own ValueError)
    try:
        _real_set(limit + _hidden)
    except RecursionError:
        at = depth()
        shown = "" if at is None else f" at the recursion depth {max(0, at - 2 - _hidden)}"  # (-2: here, depth())
        raise RecursionError(f"cannot set the recursion limit to {limit}{shown}: the limit is too low") from None
