"""A client's pool of envs on one worker, its configuration, and the batch one request collects."""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..wire.call_rules import OpTimeouts
from ..wire.protocol import MAX_ENVS_PER_SANDBOX
from .envproc import EnvProcess
from .sandbox import Limits

if TYPE_CHECKING:
    from .memory_snapshots.launcher import SnapshotLauncher

#: The client identity of the pool on the local channel (ROUTER identities never start with 0).
LOCAL_CLIENT = b"\x00local"


@dataclass
class SessionConfig:
    n: int
    isolation: str = "auto"
    mode: str = "default"
    limits: Limits = field(default_factory=Limits)
    step_timeout: float = 30.0
    reset_timeout: float = 60.0
    start_timeout: float = 60.0
    serialize_measurement: bool = False
    index_offset: int = 0
    env_vars: dict = field(default_factory=dict)
    #: Seconds without any request from the client before its envs are reclaimed.
    lease_s: float = 600.0
    #: Whether env interpreters (boltz: the template) get a randomized address-space layout.
    env_aslr: bool = False
    #: The interpreter env processes (boltz: the template) run; None: the worker's own.
    env_python: str | None = None
    #: Whether the envs may create user namespaces of their own (boltz mode: the template's filter
    #: lets them through instead of handing them to the worker's gate, which refuses them).
    nested_user_namespaces: bool = False
    #: Envs each sandboxed process hosts (its slots); ``n`` envs make ``ceil(n / K)`` sandboxes.
    envs_per_sandbox: int = 1

    @property
    def sandboxes(self) -> int:
        """How many processes (sandboxes) the session's ``n`` envs take."""
        return -(-self.n // self.envs_per_sandbox)

    @classmethod
    def from_header(cls, h: dict) -> SessionConfig:
        n = h.get("n")
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        env_vars = h.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k.isidentifier() for k, v in env_vars.items()
        ):
            raise ValueError("env_vars must map identifier names to strings")
        timeouts = {}
        for key in ("step_timeout", "reset_timeout", "start_timeout", "lease_s"):
            value = h.get(key, getattr(cls, key))
            if not isinstance(value, (int, float)) or not 0 < value <= 86400:
                raise ValueError(f"{key} must be a number of seconds in (0, 86400], got {value!r}")
            timeouts[key] = float(value)
        env_aslr = h.get("env_aslr", False)
        if not isinstance(env_aslr, bool):
            raise ValueError(f"env_aslr must be true or false, got {env_aslr!r}")
        env_python = h.get("env_python")
        if env_python is not None:
            env_python = check_env_python(env_python)
        nested = h.get("nested_user_namespaces", False)
        if not isinstance(nested, bool):
            raise ValueError(f"nested_user_namespaces must be true or false, got {nested!r}")
        k = h.get("envs_per_sandbox", 1)
        if type(k) is not int or not 1 <= k <= MAX_ENVS_PER_SANDBOX:
            raise ValueError(f"envs_per_sandbox must be an int in [1, {MAX_ENVS_PER_SANDBOX}], got {k!r}")
        mode = h.get("mode", "default")
        if mode not in ("default", "boltz"):
            raise ValueError(f"mode must be 'default' or 'boltz', got {mode!r}")
        return cls(
            n=n,
            mode=mode,
            isolation=str(h.get("isolation", "auto")),
            limits=Limits.from_json(h.get("limits")),
            serialize_measurement=bool(h.get("serialize_measurement", False)),
            index_offset=int(h.get("index_offset", 0)),
            env_vars=env_vars,
            env_aslr=env_aslr,
            env_python=env_python,
            nested_user_namespaces=nested,
            envs_per_sandbox=k,
            **timeouts,
        )


def check_env_python(path: object) -> str:
    """``path`` if it names an executable Python interpreter a sandbox shows (under ``/usr``, or in
    this worker's own Python installation); else a ``ValueError`` saying what is wrong. A client
    may not have the worker bind other host directories into its sandboxes for an interpreter."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(f"env_python must be an absolute path, got {path!r}")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"env_python {path!r} is not an executable file on this worker")
    real = os.path.realpath(path)
    shown = ["/usr", *{os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}]
    if not any(real == p or real.startswith(p.rstrip("/") + "/") for p in shown):
        raise ValueError(
            f"env_python {path!r} lies outside /usr and this worker's Python ({sys.prefix}): "
            "sandboxes do not show it; install it under /usr/local"
        )
    return path


class SessionExpired(Exception):
    """A request named a session the worker reclaimed when its lease ran out."""


class Results(Protocol):
    """Where a call's result goes: a :class:`Batch`, or what stands in for one (a snapshot call's,
    which keeps the snapshot and hands its batch the snapshot's id)."""

    def done(self, pos: int, index: int, status: str, reply: bytes, payloads: list) -> None: ...


class Batch:
    """Collects one result per item of a client request; hands itself to ``on_complete`` (the
    worker's reply) when the last one is in."""

    def __init__(self, client: bytes, seq, size: int, on_complete: Callable[[Batch], None]):
        self.on_complete = on_complete
        self.client = client
        self.seq = seq
        self.results: list = [None] * size
        self.remaining = size
        self.t0 = time.perf_counter()
        #: The session whose idle envs are lent to the client with the reply (a local pool's).
        self.lend_from: Session | None = None
        #: Its session's books (:class:`~boltzlabs_gym.worker.stats.SessionStats`), and how many
        #: envs its items cover (more than ``size`` when a sandbox hosts several).
        self.stats: Any = None
        self.envs = size
        #: Sealed observation-region descriptors (``obs_region`` items) that go with the reply.
        self.region_fds: list[int] = []

    def done(self, pos: int, index: int, status: str, reply: bytes, payloads: list) -> None:
        if self.results[pos] is not None:
            return
        self.results[pos] = (index, status, reply, payloads)
        self.remaining -= 1
        if self.remaining == 0:
            self.on_complete(self)


def pack_results(results: list) -> tuple[list, bytes]:
    """A batch reply's ``results`` entries and its one data frame, from ``(index, status, reply,
    payloads)`` results. One frame for the whole batch: a frame costs ZeroMQ (and the client)
    several microseconds, which at two or more frames per env was most of a cheap env's reply cost."""
    entries, parts = [], []
    for index, status, reply, payloads in results:
        sizes = [len(reply)]
        parts.append(reply)
        for payload in payloads:
            sizes.append(len(payload))
            parts.append(payload)
        entries.append([index, status, sizes])
    return entries, b"".join(parts)


class Session:
    """One client's pool of envs on this worker."""

    def __init__(
        self,
        sid: str,
        client: bytes,
        env_dir: str,
        root: str,
        cfg: SessionConfig,
        backend: Any,
        copies: SnapshotLauncher | None = None,
    ):
        self.sid = sid
        self.client = client
        self.env_dir = env_dir
        self.root = root
        self.cfg = cfg
        k = cfg.envs_per_sandbox
        #: Op name -> its deadline in seconds (the rule the lane follows too).
        self.timeouts = OpTimeouts(cfg.step_timeout, cfg.reset_timeout)
        #: what launches its envs: an isolation backend, or boltz mode's template launcher
        self.backend = backend
        #: what makes its envs' memory snapshots; None where its launcher cannot copy an env
        self.copies = copies
        #: One process per sandbox: sandbox ``b`` hosts the ``count`` envs from pool index ``global_index``.
        self.envs = [
            EnvProcess(b, cfg.index_offset + b * k, os.path.join(root, "ws", str(b))) for b in range(cfg.sandboxes)
        ]
        for env in self.envs:
            env.session = self
            env.count = min(k, cfg.n - env.index * k)
            env.serve_envs(env.count)
        self.started = 0
        self.create_seq = None
        self.closed = False
        self.last_seen = time.monotonic()
        self.owner_key: str | None = None
        self.progress_sent = 0.0
        self.token = secrets.token_hex(16)
        #: Whether the client (a local pool) takes the envs' pipes when they are idle.
        self.lend = False
