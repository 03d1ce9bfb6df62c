"""This env process: where it runs, its protocol channel, and the hooks a boltz template installs.

Every env host (:mod:`~boltzlabs_gym.envside.json_host`, :mod:`~boltzlabs_gym.envside.gym_start`) starts
the same way: it takes the protocol's fds away from user code (:func:`protect_channel_fds`),
reads where its env directory and workspace are, and, once the env is built, moves the heap out
of the cyclic GC's reach (:func:`freeze_heap`). Standard library only: it is loaded inside every
sandbox, possibly by an interpreter that has nothing else installed.

``mode="boltz"``: a template process runs the env's ``env.py`` and must fork envs from inside
``serve()``. The fork loop is the template's own code (:mod:`boltzlabs_gym.envside.forkserver`);
this module only holds the hook it installs (:func:`install_template_hook`, called by the
template's bootstrap before ``env.py`` runs) and :func:`template_fork`, which ``serve()`` calls
and which returns only in a forked env. The memory-snapshot maker of a boltz env is installed
here the same way (:func:`install_memory_snapshots`).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

__all__ = [
    "ENV_DIR",
    "WORKSPACE",
    "ENV_INDEX",
    "PerEnvInt",
    "PerEnvStr",
    "workspace_now",
    "in_template",
    "install_template_hook",
    "template_fork",
    "install_memory_snapshots",
    "memory_snapshots",
    "channel_fds",
    "protect_channel_fds",
    "protect_channel",
    "freeze_heap",
]

# ----------------------------------------------------------------------------------- where the env is

#: Where the env directory is, read-only. ``/env`` inside a namespace sandbox; the
#: real directory under the ``process`` backend. Portable env code uses this name.
ENV_DIR: str = os.environ.get("BOLTZLABS_ENV_DIR", "/env")
#: The env's private, writable directory (``/workspace`` inside a sandbox).
WORKSPACE: str = os.environ.get("BOLTZLABS_WORKSPACE", "/workspace")
#: This env's index in its pool (0-based), or -1 when run by hand.
ENV_INDEX: int = int(os.environ.get("BOLTZLABS_ENV_INDEX", "-1"))


class PerEnvInt(int):
    """In a boltz template: ``ENV_INDEX``, found by identity and rebound in every forked env."""


class PerEnvStr(str):
    """In a boltz template: ``ENV_DIR``/``WORKSPACE``, rebound in every forked env."""


def workspace_now() -> str:
    """The workspace directory as the environment says it now (a boltz fork's, once forked)."""
    return os.environ.get("BOLTZLABS_WORKSPACE") or WORKSPACE


# ----------------------------------------------------------------------------------- mode="boltz"

#: Set (to the isolation kind) only in a ``mode="boltz"`` template process: serve() forks envs.
_template: str = os.environ.get("BOLTZLABS_TEMPLATE", "")
if _template:
    # Distinct objects the fork loop finds by identity in every module that imported them.
    ENV_DIR, WORKSPACE, ENV_INDEX = PerEnvStr(ENV_DIR), PerEnvStr(WORKSPACE), PerEnvInt(ENV_INDEX)
#: The fork loop, installed by the template's bootstrap (worker code, never imported from here).
_template_hook: Callable[[], None] | None = None


#: What makes memory snapshots in this env process (boltz mode's namespaces backend installs it; see
#: :mod:`boltzlabs_gym.envside.memory_snapshot`), or None where there are none.
_memory_snapshots: Any = None


def install_memory_snapshots(maker: Any) -> None:
    """Let this env take memory snapshots through ``maker`` (``refusal()``, ``snapshot()``, ``take_copy()``)."""
    global _memory_snapshots
    _memory_snapshots = maker


def memory_snapshots() -> Any:
    """This process's memory-snapshot maker, or None (every env that is not a boltz namespaces env)."""
    return _memory_snapshots


def in_template() -> bool:
    """Whether this process is a boltz template (``serve()`` forks envs) rather than an env."""
    return bool(_template)


def install_template_hook(hook: Callable[[], None]) -> None:
    """Make :func:`template_fork` run ``hook``: the fork loop, which returns only in a forked env."""
    global _template_hook
    _template_hook = hook


def template_fork() -> None:
    """``mode="boltz"``: in the template, serve fork requests here; returns only in a forked env.

    A no-op in every ordinary env process (and in a forked env: it is an env from then on).
    """
    global _template
    if not _template:
        return
    if _template_hook is None:
        sys.exit(
            "boltzlabs: BOLTZLABS_TEMPLATE is set, but this interpreter was not started by a boltz template "
            "(no fork loop installed)"
        )
    _template_hook()
    _template = ""


# ----------------------------------------------------------------------------------- the channel

#: The protocol's fds (requests in, replies out) once :func:`protect_channel_fds` took them.
_channel: tuple[int, int] | None = None


def channel_fds() -> tuple[int, int] | None:
    """The fds this env reads requests from and writes replies to, or None before it serves."""
    return _channel


def protect_channel_fds() -> tuple[int, int]:
    """Take fds 0/1 for the protocol and point ``print()`` (and fd 1) at stderr.

    User code, the libraries it imports and the subprocesses it starts all write
    to fd 1 by habit; any such byte would corrupt the reply stream. After this,
    fd 1 is a copy of stderr and only the returned fds (private copies of the old
    0 and 1) reach the worker.
    """
    global _channel
    proto_in, proto_out = os.dup(0), os.dup(1)
    _channel = (proto_in, proto_out)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - stdin for the life of the process
    sys.stdout = sys.stderr
    return proto_in, proto_out


def protect_channel() -> tuple[BinaryIO, BinaryIO]:
    """:func:`protect_channel_fds`, as buffered streams."""
    proto_in, proto_out = protect_channel_fds()
    return os.fdopen(proto_in, "rb", buffering=1 << 16), os.fdopen(proto_out, "wb", buffering=1 << 16)


# ----------------------------------------------------------------------------------- the heap


def freeze_heap() -> None:
    """Move everything alive now (modules, the env, its simulator) out of the cyclic GC's reach.

    Called once the env is built, before serving: a serving env allocates a few container
    objects per step, so the collector runs every few dozen steps, and each older-generation
    collection walks every tracked object of the interpreter (tens of thousands with
    Gymnasium and NumPy imported), in a process whose caches are cold at every step.
    Measured on 64 CartPole envs on 2 cores: about 25% less env CPU per step. The young
    generations are collected first (2 ms); a full collection would add 12-21 ms to every
    env start and hard reset and found nothing to free after building CartPole. What the
    env allocates later is collected as usual.
    """
    gc.collect(1)
    gc.freeze()
