"""Every setting of a pool, in one frozen, checked object: :class:`PoolOptions`.

A pool takes its settings as keywords (``RLPool(env_dir, n, step_timeout=5)``), as one object
(``RLPool(env_dir, n, options=PoolOptions(step_timeout=5))``), or both: a keyword overrides the
object's field. Each face that builds a pool (:mod:`boltzlabs_gym.aio`, :mod:`boltzlabs_gym.sb3`,
:mod:`boltzlabs_gym.code`, :mod:`boltzlabs_gym.integrations`) folds its keywords into one
:class:`PoolOptions` with :meth:`PoolOptions.fold` and hands that on, so the defaults and the
checks live here only, and the keywords are typed: :class:`PoolSettings` mirrors the fields.

>>> options = PoolOptions(mode="boltz", step_timeout=5)
>>> options.step_timeout, options.reset_timeout
(5.0, 60.0)
>>> PoolOptions.fold(options, {"step_timeout": 2}).step_timeout
2.0
>>> PoolOptions(step_timeout=0)
Traceback (most recent call last):
...
ValueError: step_timeout must be a positive number of seconds, got 0

A new setting is one field here (with its docstring, which the API reference and the command
line's help show), one line in :class:`PoolSettings`, and its check in ``__post_init__``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import operator
import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypedDict

from ..wire.keys import ClientKeys
from ..wire.limits import Limits
from ..wire.protocol import DEFAULT_BUSY_POLL_US, WORKER_FLAGS, check_poll_us
from .sandbox_replies import check_envs_per_sandbox

__all__ = ["MODES", "UNSET", "PoolOptions", "PoolSettings", "Unset", "WorkerConfig", "field_docs"]

#: The values of :attr:`PoolOptions.mode`.
MODES = ("default", "boltz")
#: The values of :attr:`PoolOptions.worker_loss` (``None``: the default for the pool's workers).
WORKER_LOSS = ("raise", "report")


class _ReadOnlyDict(dict):
    """A dict that refuses changes (a frozen :class:`PoolOptions`' ``env_vars``), and that pickles
    and hashes, as the options it is part of do."""

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("PoolOptions.env_vars is read-only: dataclasses.replace(options, env_vars=...) makes a copy")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple:
        return _ReadOnlyDict, (dict(self),)


class WorkerConfig(NamedTuple):
    """What a pool tells its workers, from :meth:`PoolOptions.worker_config`."""

    #: The settings of the session of envs every worker creates for the pool (its ``create`` request).
    session: dict[str, Any]
    #: The command-line flags of the pool's own local worker (``python -m boltzlabs_gym.worker``).
    flags: list[str]


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """Every setting of an :class:`~boltzlabs_gym.RLPool`, checked when made (``ValueError`` or
    ``TypeError`` naming the setting); frozen: :func:`dataclasses.replace` makes a changed copy.

    The settings that depend on where the pool runs (``split``, ``metrics_port``,
    ``snapshot_budget``, ``worker_loss="report"``) are checked again against its workers by
    :meth:`placed`, when the pool starts.
    """

    isolation: str = "auto"
    """``"auto"`` (best available, warns on fallback), ``"strict"`` (refuse to run without a real
    sandbox), or a backend name (``"namespaces"``, ``"bwrap"``, ``"process"``). Pools on the
    workers of a source that runs only sandboxed (``boltzlabs_gym.ray.RayWorkers``) take
    ``"auto"`` as ``"strict"``."""

    mode: str = "default"
    """``"default"``: one fresh interpreter per env; ``"boltz"``: every env is forked from a warm
    template process that imported the env once (denser pools, faster hard resets). No fallback
    between the two."""

    step_timeout: float = 30.0
    """Per-step deadline in seconds; an env that misses it is killed and reported as a straggler
    (``info["boltzlabs_straggler"]``)."""

    reset_timeout: float = 60.0
    """Deadline in seconds for resets and other calls."""

    start_timeout: float = 120.0
    """Deadline in seconds for an env's interpreter start plus its first request (a ``describe``;
    a hard reset's seeded reset)."""

    limits: Limits = Limits()
    """Per-env resource limits (memory, processes, files, ...): a :class:`~boltzlabs_gym.Limits`."""

    serialize_measurement: bool = False
    """Run one env step at a time per worker host (for rewards that are timings); resets stay
    concurrent."""

    env_vars: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment variables for every env process (names to strings), kept read-only."""

    keys: str | os.PathLike | ClientKeys | None = None
    """CURVE key directory (``boltzlabs-gym keygen``) for authenticated remote workers, or
    :class:`~boltzlabs_gym.wire.keys.ClientKeys` held in memory (a worker source brings its own)."""

    split: Sequence[int] | None = None
    """Explicit number of envs per remote worker (in the order of ``workers``), summing to ``n``;
    default: split by the workers' free capacity."""

    heartbeat_interval: float = 1.0
    """Seconds between the pings the pool sends a worker while it waits for it."""

    heartbeat_timeout: float = 10.0
    """Seconds of silence after which a worker counts as dead or unreachable (more than
    ``heartbeat_interval``)."""

    lease: float = 600.0
    """Seconds a remote worker keeps this pool's envs without hearing from it."""

    busy_poll_us: float = DEFAULT_BUSY_POLL_US
    """Microseconds a local pool's worker keeps polling, awake, for the next request after
    answering one, when the previous one came at least that fast (it saves a wake-up per batch:
    30-60 us in a VM); 0 always sleeps. Remote workers always sleep."""

    env_aslr: bool = False
    """Give every env interpreter a randomized address-space layout. Off by default: envs then
    share one layout, as forked envs (boltz mode, AsyncVectorEnv, SubprocVecEnv) always do, and
    the CPU's branch predictors and caches carry over from env to env (about 30% less CPU per
    CartPole step with 64 fresh interpreters on 2 vCPUs). Inside a sandbox that runs untrusted
    code anyway the randomization guards nothing outside it; the worker and the trainer keep
    theirs. In boltz mode it applies to the template, whose layout every forked env shares."""

    env_python: str | None = None
    """The Python interpreter env processes (and, in boltz mode, the template) run, by absolute
    path: a venv's ``bin/python`` with the packages the envs need, say (the code runner's runtime
    interpreter). It must lie under ``/usr`` or in the worker's own Python installation, which
    every sandbox shows; the library's own env-side code comes from the worker (standard library
    only). Default: the worker's own interpreter."""

    nested_user_namespaces: bool = False
    """Let the envs (boltz mode, ``namespaces`` backend) create user namespaces of their own, with
    PID, mount, IPC, net and UTS namespaces under them. Off by default: the template's seccomp
    filter then hands every such call to the worker, which refuses it. The code runner turns it on
    for ``wipe=False``, where its env starts every program in namespaces made for that program
    alone (see ``docs/code-server.md``), and its programs' own filter refuses them again. What an
    env gains is what an unprivileged user has on a stock distribution."""

    direct: bool = True
    """Let a local pool step idle envs on their own pipes (lent by its worker, see
    :mod:`boltzlabs_gym.client.direct_lane`) instead of through the worker: one process hop less
    per step, same limits, deadlines and failure reports. ``False`` sends everything through the
    worker, as remote pools always do."""

    shared_obs: bool = True
    """A local pool asks each env process for a shared observation region (a sealed memfd, mapped
    read-only in the trainer) and its envs' array observations come through it rather than through
    their pipes; see :mod:`boltzlabs_gym.client.obs_regions`. Remote pools never do: ``False``
    keeps bytes everywhere."""

    envs_per_sandbox: int = 1
    """How many envs share one sandboxed process (default 1: every env in its own). With K > 1 env
    ``i`` is slot ``i % K`` of sandbox ``i // K``: one request and one reply per sandbox per batch,
    array observations in one block (much faster for cheap envs), but the K envs of a sandbox share
    its memory, files and fate: a crash or a missed deadline restarts all of them, and
    ``step_timeout`` covers the sandbox's K steps, served one after another. Limits apply per
    sandbox. Keep K = 1 for untrusted code; see :mod:`boltzlabs_gym.client.sandbox_replies`. Env
    directories must serve independent instances (``serve(factory=...)``) for K > 1."""

    metrics_port: int | None = None
    """Serve the local worker's Prometheus ``/metrics`` on this port of 127.0.0.1 (0: a free one;
    the pool's ``metrics_url`` says where). Needs the ``metrics`` extra. Remote workers serve their
    own (``boltzlabs-gym worker --metrics-port``)."""

    snapshot_budget: int | None = None
    """Bytes of env snapshots the local worker holds (``None``: the worker's default, 1 GiB).
    Remote workers have their own (``boltzlabs-gym worker --snapshot-budget``)."""

    worker_loss: str | None = None
    """What a remote worker lost past ``heartbeat_timeout`` does to a call: ``"raise"`` a
    :class:`~boltzlabs_gym.WorkerError`, or ``"report"`` its envs' results as errors in their slots
    (truncated episodes, ``info["boltzlabs_error"]``) until a hard reset re-creates them on the
    worker that took its place in a :class:`~boltzlabs_gym.client.sources.WorkerSource`.
    ``None``: ``"report"`` for a source, ``"raise"`` otherwise. ``"report"`` needs
    ``envs_per_sandbox=1``."""

    def __post_init__(self) -> None:
        def keep(name: str, value: object) -> None:  # a frozen field, normalised once here
            object.__setattr__(self, name, value)

        if not isinstance(self.isolation, str):  # which names a worker has, it says itself
            raise ValueError(f"isolation must be 'auto', 'strict' or a backend's name, got {self.isolation!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("step_timeout", "reset_timeout", "start_timeout", "heartbeat_interval", "lease"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
            keep(name, float(value))
        if isinstance(self.heartbeat_timeout, bool) or not isinstance(self.heartbeat_timeout, (int, float)):
            raise ValueError(f"heartbeat_timeout must be a number of seconds, got {self.heartbeat_timeout!r}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must be greater than heartbeat_interval > 0")
        keep("heartbeat_timeout", float(self.heartbeat_timeout))
        keep("busy_poll_us", check_poll_us("busy_poll_us", self.busy_poll_us))
        if self.env_python is not None and (not isinstance(self.env_python, str) or not os.path.isabs(self.env_python)):
            raise ValueError(f"env_python must be an absolute path to a Python interpreter, got {self.env_python!r}")
        for name in ("serialize_measurement", "env_aslr", "nested_user_namespaces", "direct", "shared_obs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_envs_per_sandbox(self.envs_per_sandbox)
        if self.limits is None:  # as the keyword always took it: no limits of its own
            keep("limits", Limits())
        elif not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be a boltzlabs_gym.Limits, got {type(self.limits).__name__}")
        env_vars = {} if self.env_vars is None else self.env_vars
        if not isinstance(env_vars, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and k.isidentifier() for k, v in env_vars.items()
        ):
            raise ValueError(f"env_vars must map identifier names to strings, got {self.env_vars!r}")
        keep("env_vars", _ReadOnlyDict(env_vars))
        if self.keys is not None and not isinstance(self.keys, (str, os.PathLike, ClientKeys)):
            raise TypeError(f"keys must be a key directory or ClientKeys, got {type(self.keys).__name__}")
        if self.split is not None:
            try:
                split: tuple[int, ...] | None = tuple(operator.index(c) for c in self.split)
            except TypeError:  # not a sequence of ints (numpy's count as ints)
                split = None
            if split is None or min(split, default=0) < 0:
                raise ValueError(f"split must give one count (an int >= 0) per worker, got {self.split!r}")
            if any(c % self.envs_per_sandbox for c in split[:-1]):
                raise ValueError(
                    f"split counts must be multiples of envs_per_sandbox={self.envs_per_sandbox} (but the last): "
                    f"a sandbox cannot span workers; got {self.split!r}"
                )
            keep("split", split)
        if self.metrics_port is not None and (type(self.metrics_port) is not int or not 0 <= self.metrics_port < 65536):
            raise ValueError(f"metrics_port must be an int in [0, 65535], got {self.metrics_port!r}")
        if self.snapshot_budget is not None and (type(self.snapshot_budget) is not int or self.snapshot_budget < 0):
            raise ValueError(f"snapshot_budget must be a number of bytes >= 0, got {self.snapshot_budget!r}")
        if self.worker_loss is not None and self.worker_loss not in WORKER_LOSS:
            raise ValueError(f"worker_loss must be 'raise' or 'report', got {self.worker_loss!r}")
        if self.worker_loss == "report" and self.envs_per_sandbox != 1:
            raise ValueError("worker_loss='report' is for remote workers with envs_per_sandbox=1")

    @classmethod
    def fold(cls, options: PoolOptions | None, settings: PoolSettings | Mapping[str, Any]) -> PoolOptions:
        """``options`` (default: every default) with the keyword ``settings`` over its fields: what a
        face was given, as one object. ``TypeError`` for a setting that is not one, naming it."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(
                f"unknown pool setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"the pool's settings are: {', '.join(SETTINGS)}"
            )
        if options is None:
            return cls(**settings)
        if not isinstance(options, PoolOptions):
            raise TypeError(f"options must be a PoolOptions, got {type(options).__name__}")
        return dataclasses.replace(options, **settings) if settings else options

    def placed(self, n: int, workers: Sequence[str] | None, *, source: object = None) -> PoolOptions:
        """These options for a pool of ``n`` envs on ``workers`` (remote addresses; ``None``: the pool
        starts its own), checked against them, with ``worker_loss`` and ``isolation`` resolved
        (``source``: the :class:`~boltzlabs_gym.client.sources.WorkerSource` the workers came from)."""
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if self.worker_loss == "report" and not workers:
            raise ValueError("worker_loss='report' is for remote workers with envs_per_sandbox=1")
        if self.split is not None and (not workers or len(self.split) != len(workers) or sum(self.split) != n):
            raise ValueError(f"split must give one count per worker and sum to n={n}, got {self.split!r}")
        for name in ("metrics_port", "snapshot_budget"):
            if getattr(self, name) is not None and workers:
                raise ValueError(
                    f"{name} is for the pool's own local worker; start remote workers with "
                    f"`boltzlabs-gym worker {WORKER_FLAGS[name]} {'PORT' if name == 'metrics_port' else 'BYTES'}`"
                )
        if self.metrics_port is not None:
            from ..extras import require
            from ..wire.metrics_port import check_port

            require("prometheus_client", "metrics", "metrics_port")
            check_port(self.metrics_port)
        loss = self.worker_loss or ("report" if source is not None and self.envs_per_sandbox == 1 else "raise")
        isolation = self.isolation
        if isolation == "auto" and getattr(source, "sandboxed_only", False):
            # Workers in a Ray cluster: an env without a sandbox would run as the Ray user, with the
            # network (Ray's unauthenticated GCS and dashboard) and Ray's files in reach.
            isolation = "strict"
        return dataclasses.replace(self, worker_loss=loss, isolation=isolation)

    def worker_config(self, *, remote: bool) -> WorkerConfig:
        """What the pool tells its workers: the settings of the session each creates for it, and the
        flags its own local worker starts with (the settings in ``WORKER_FLAGS``, where set)."""
        session = {
            "isolation": self.isolation,
            "mode": self.mode,
            "limits": self.limits.to_json(),
            "step_timeout": self.step_timeout,
            "reset_timeout": self.reset_timeout,
            "start_timeout": self.start_timeout,
            "serialize_measurement": self.serialize_measurement,
            "env_vars": dict(self.env_vars),
            "env_aslr": self.env_aslr,
            "env_python": self.env_python,
            "nested_user_namespaces": self.nested_user_namespaces,
            "envs_per_sandbox": self.envs_per_sandbox,
            # A local worker dies with its pool's process; only remote ones need a lease.
            "lease_s": self.lease if remote else 86400.0,
        }
        flags: list[str] = []
        for name, flag in WORKER_FLAGS.items():
            value = getattr(self, name)
            if value is not None:
                flags += [flag, repr(value) if isinstance(value, float) else str(value)]
        return WorkerConfig(session, flags)


class PoolSettings(TypedDict, total=False):
    """The fields of :class:`PoolOptions` as keyword arguments (``**settings: Unpack[PoolSettings]``):
    what type checkers see of ``RLPool(env_dir, n, step_timeout=5)`` and of every face that forwards
    pool settings. Same names and types as the fields (a test holds them together)."""

    isolation: str
    mode: str
    step_timeout: float
    reset_timeout: float
    start_timeout: float
    limits: Limits
    serialize_measurement: bool
    env_vars: Mapping[str, str]
    keys: str | os.PathLike | ClientKeys | None
    split: Sequence[int] | None
    heartbeat_interval: float
    heartbeat_timeout: float
    lease: float
    busy_poll_us: float
    env_aslr: bool
    env_python: str | None
    nested_user_namespaces: bool
    direct: bool
    shared_obs: bool
    envs_per_sandbox: int
    metrics_port: int | None
    snapshot_budget: int | None
    worker_loss: str | None


#: The names of the pool's settings, in the order of :class:`PoolOptions`'s fields.
SETTINGS = tuple(f.name for f in dataclasses.fields(PoolOptions))


class Unset(enum.Enum):
    """The default of a pool setting that a face takes as an explicit parameter (``make_vec``'s):
    not given, so ``options``' field or the :class:`PoolOptions` default applies. ``None`` cannot
    say this, since ``None`` is a value several settings take (``keys``, ``split``, ...)."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset.UNSET


def given_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The pool settings among ``values`` that were given (not :data:`UNSET`)."""
    return {name: value for name, value in values.items() if name in SETTINGS and value is not UNSET}


def field_docs(cls: type = PoolOptions) -> dict[str, str]:
    """Each field's docstring (the string under it in ``cls``'s body), read from the source: what
    the API reference renders and the command line's help quotes. Empty without the source."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return {}
    return {
        a.target.id: inspect.cleandoc(b.value.value)
        for a, b in zip(body, body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
        if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)
    }
