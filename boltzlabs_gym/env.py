"""What an env directory's ``env.py`` imports: :func:`serve`, and where the env's files are.

``serve`` answers the worker's requests on stdin/stdout for the life of the process::

    # envs/counter/env.py
    from boltzlabs_gym.env import serve
    state = {"t": 0}
    def reset(seed):
        state["t"] = 0
        return {"t": 0}
    def step(action):
        state["t"] += 1
        return {"t": state["t"]}, float(action), state["t"] >= 100, {}
    serve(reset=reset, step=step)

``ENV_DIR`` (read-only) and ``WORKSPACE`` (writable) name the env's two directories under every
isolation backend. The line protocol ``serve`` speaks (an env may speak it itself, in any language)
is :mod:`boltzlabs_gym.envside.json_host`'s. Standard library only: imported in every sandbox.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .envside.framing import ProtocolError, read_message, write_message
from .envside.json_host import serve_json
from .envside.process_setup import ENV_DIR, ENV_INDEX, WORKSPACE

__all__ = ["serve", "measurement", "ENV_DIR", "WORKSPACE", "ENV_INDEX"]
__all__ += ["read_message", "write_message", "ProtocolError"]  # the framing, for an env that speaks the protocol itself


@contextmanager
def measurement() -> Iterator[Any]:
    """Time a section of a step (``with measurement() as m: ...; m.elapsed_s``), so an env can
    report it. The worker's ``serialize_measurement=True`` gate already runs one host's steps one
    at a time."""

    class _Span:
        elapsed_s = 0.0

    span = _Span()
    start = time.perf_counter()
    try:
        yield span
    finally:
        span.elapsed_s = time.perf_counter() - start


def serve(
    reset: Callable[..., Any] | None = None,
    step: Callable[[Any], Any] | None = None,
    *,
    factory: Callable[[], Any] | None = None,
    observation_space: dict | None = None,
    action_space: dict | None = None,
    metadata: dict | None = None,
    get_state: Callable[[], Any] | None = None,
    set_state: Callable[[Any], Any] | None = None,
    reseed: Callable[[int], Any] | None = None,
) -> None:
    """Serve an env to the worker until it closes the channel: ``reset``/``step`` functions, or
    the objects ``factory()`` builds.

    ``reset(seed)`` (or ``reset(seed, options=...)``) returns the first observation, or
    ``(obs, info)``. ``step(action)`` returns ``(obs, reward, done, info)`` or Gymnasium's
    ``(obs, reward, terminated, truncated, info)``. Observations, actions and infos are JSON values.

    ``factory``, instead: a callable returning an object with ``reset(seed, options=None)`` and
    ``step(action)`` of those conventions (and ``close()``, if it has one). It is called once per
    env the process hosts, so each env has its own state: the form a sandbox of several envs
    (``envs_per_sandbox`` > 1) needs. A factory that takes one argument is given the env's index
    in its pool (``ENV_INDEX`` names only the sandbox's first env)::

        class Counter:
            def __init__(self, index):
                self.index, self.t = index, 0
            def reset(self, seed, options=None):
                self.t = 0
                return {"t": 0, "env": self.index}
            def step(self, action):
                self.t += 1
                return {"t": self.t, "env": self.index}, float(action), self.t >= 100, {}

        serve(factory=Counter)

    ``observation_space``/``action_space`` optionally declare Gymnasium spaces in their JSON form
    (:mod:`boltzlabs_gym.wire.spaces`; ``{"type": "Discrete", "n": 2}``), so that the vector env
    can batch observations into arrays.

    A ``print()`` in user code goes to stderr, never into the channel. An exception in ``reset``
    or ``step`` becomes a terminal transition whose info carries the traceback
    (``info["boltzlabs_exception"]``); the process keeps serving.

    Snapshots (``pool.snapshot(i)``, ``pool.fork(i, into=...)``; :mod:`boltzlabs_gym.envside.state`):
    a factory's env object is pickled as it is, unless it has ``get_state()``/``set_state(state)``
    methods, which are used instead. The function form keeps its state in module globals, which
    only a memory snapshot (``kind="memory"``, and what ``"auto"`` takes wherever the pool can:
    ``mode="boltz"``, namespaces backend) copies; for the portable kind pass ``get_state=``
    (returns picklable state) and ``set_state=`` (takes it back). ``reseed=`` (or a
    ``reseed(seed)`` method) is called when a fork asks for its own random streams (``random``
    and NumPy's global generator are reseeded in any case). The workspace's files are part of
    every snapshot.
    """
    serve_json(reset, step, factory, observation_space, action_space, metadata, get_state, set_state, reseed)
