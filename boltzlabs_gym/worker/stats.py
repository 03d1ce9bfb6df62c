"""The worker's own bookkeeping of what happens to its envs: plain counters, no dependencies.

Two readers use it: the ``status`` op (``boltzlabs-gym top``), and, when the worker serves
``/metrics``, the Prometheus collector of :mod:`.prometheus`, which turns these numbers into
metric families at scrape time. Nothing here imports ``prometheus_client``: a worker without
the ``metrics`` extra keeps the same books, at the same cost.

What it costs on the step path, by design (see the README, "Observability"):

* per batch reply: one latency into a bucket array and a ring of recent latencies, one
  count of env calls (about a microsecond, against a batch's milliseconds);
* per env reply: one comparison; one env in :data:`ENV_SAMPLE_EVERY` has its step latency
  bucketed (the env-step histogram is sampled, so its ``_count`` counts samples);
* per fault, start or upload: a few dictionary updates (rare events).

Only the event loop's thread writes; the ``/metrics`` thread reads ints and copies dicts
(each copy is one C call under the GIL), so no lock is taken on the loop's side.

Units: the env counts (``calls``, ``stragglers``, ``crashes``, ``hard_resets``) count envs,
so with ``envs_per_sandbox`` K > 1 one sandbox killed at its deadline adds K stragglers, as
``pool.timing.total_stragglers`` does; ``oom_kills``, ``bad_replies``, ``respawns`` and
start-up times count sandbox processes, which is what the kernel kills and the worker starts.

>>> classify_fault("missed the 1 s deadline for 'step' (waited 1.02 s); killed", straggler=True)
'straggler'
>>> classify_fault("the env exited with status 3", straggler=False)
'exit'
>>> classify_fault("malformed reply: not a JSON line (starts with 'x')", straggler=False)
'bad_reply'
>>> b = LatencyBuckets()
>>> b.observe(0.0004); b.observe(0.003); b.count, round(b.total, 4)
(2, 0.0034)
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Iterable

from ..wire.counters import RATE_WINDOW_S, RECENT_LATENCIES, RecentCounts, percentile

__all__ = [
    "CRASH_REASONS",
    "ENV_SAMPLE_EVERY",
    "LATENCY_BOUNDS_S",
    "LatencyBuckets",
    "RecentCounts",
    "SessionStats",
    "WorkerStats",
    "classify_bad_reply",
    "classify_fault",
    "percentile",
]

#: Histogram bucket upper bounds in seconds (env steps and batches: 50 us to a minute).
LATENCY_BOUNDS_S = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: Start-up (interpreter boot and first answer) bucket bounds in seconds.
START_BOUNDS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: One env reply in this many has its latency bucketed (the rest cost one comparison).
ENV_SAMPLE_EVERY = 8

#: The ``reason`` label of a crash (an env that failed other than by missing its step deadline),
#: and of a respawn (those plus ``straggler``): a small fixed set, never free text.
CRASH_REASONS = ("exit", "signal", "oom", "bad_reply", "deadline", "pipe", "launch", "other")
#: The ``reason`` label of a bad reply (an env broke the pipe protocol).
BAD_REPLY_REASONS = ("malformed", "oversized", "stray", "other")


def classify_bad_reply(reason: str) -> str | None:
    """The :data:`BAD_REPLY_REASONS` value of a fault reason, or ``None`` if it is not a bad reply."""
    if reason.startswith("malformed reply"):
        return "malformed"
    if "longer than" in reason or "over the limit" in reason:
        return "oversized"
    if "output nobody asked for" in reason or "answered before reading" in reason:
        return "stray"
    if "partial message" in reason or "half sent" in reason:
        return "other"
    return None


def classify_fault(reason: str, straggler: bool) -> str:
    """The label of a fault: ``straggler`` or one of :data:`CRASH_REASONS`, from the words the
    worker reports it with (:meth:`~boltzlabs_gym.worker.spawner.Spawner.kill_and_explain`)."""
    if straggler:
        return "straggler"
    if "OOM killer" in reason:
        return "oom"
    if classify_bad_reply(reason) is not None:
        return "bad_reply"
    if "exited with status" in reason:
        return "exit"
    if "killed by signal" in reason:
        return "signal"
    if reason.startswith("missed the"):
        return "deadline"
    if "closed its std" in reason:
        return "pipe"
    if reason.startswith("could not launch"):
        return "launch"
    return "other"


class LatencyBuckets:
    """A cumulative-free histogram: one count per bucket of ``bounds`` (seconds) plus +Inf, and the sum."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BOUNDS_S):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, count <= le), ..., ("+Inf", count)]``, as a Prometheus histogram lists them."""
        out, running = [], 0
        counts = list(self.counts)  # one copy: the loop's thread may add meanwhile
        for bound, n in zip(self.bounds, counts):
            running += n
            out.append((repr(bound), running))
        out.append(("+Inf", running + counts[-1]))
        return out


class SessionStats:
    """One session's books (a pool's envs on this worker)."""

    def __init__(self, sid: str, n: int, envs_per_sandbox: int, mode: str):
        self.sid, self.n, self.envs_per_sandbox, self.mode = sid, n, envs_per_sandbox, mode
        self.opened = time.monotonic()
        #: Env calls answered (steps, resets, others), through the worker and, as the pool
        #: reports them, on a local pool's direct lane.
        self.calls = 0
        self.lane_calls = 0
        self.batches = 0
        self.lane_batches = 0
        self.batch_latency = LatencyBuckets()
        self.lane_batch_latency = LatencyBuckets()
        self.env_step_latency = LatencyBuckets()  # sampled, worker-routed calls only
        self.recent_batch_s: collections.deque[float] = collections.deque(maxlen=RECENT_LATENCIES)
        self.recent_env_s: collections.deque[float] = collections.deque(maxlen=RECENT_LATENCIES)
        self.recent_calls = RecentCounts()
        self.recent_stragglers = RecentCounts()
        self.recent_crashes = RecentCounts()
        self.stragglers = 0
        self.crashes: dict[str, int] = {}  # reason -> envs
        self.bad_replies: dict[str, int] = {}  # reason -> sandbox processes
        self.oom_kills = 0
        self.respawns: dict[str, int] = {}  # reason -> sandbox processes
        self.hard_resets = 0
        self.start_latency = LatencyBuckets(START_BOUNDS_S)

    # ------------------------------------------------------------------ the step path
    def batch_done(self, seconds: float, calls: int) -> None:
        """A batch reply went out: ``calls`` env calls in ``seconds`` on this worker."""
        self.batches += 1
        self.calls += calls
        self.batch_latency.observe(seconds)
        self.recent_batch_s.append(seconds)
        self.recent_calls.add(calls)

    def env_step_sampled(self, seconds: float) -> None:
        self.env_step_latency.observe(seconds)
        self.recent_env_s.append(seconds)

    def lane_report(self, calls: int, batch_seconds: list[float]) -> None:
        """What a local pool stepped on its direct lane since its last report (see
        :mod:`boltzlabs_gym.client.direct_lane`)."""
        self.lane_calls += calls
        self.recent_calls.add(calls)
        self.lane_batches += len(batch_seconds)
        for seconds in batch_seconds:
            self.lane_batch_latency.observe(seconds)
            self.recent_batch_s.append(seconds)

    # ------------------------------------------------------------------ events
    def fault(self, kind: str, reason: str, envs: int) -> None:
        """A sandbox of ``envs`` envs was killed; ``kind`` from :func:`classify_fault`."""
        if kind == "straggler":
            self.stragglers += envs
            self.recent_stragglers.add(envs)
        else:
            self.crashes[kind] = self.crashes.get(kind, 0) + envs
            self.recent_crashes.add(envs)
        if kind == "oom":
            self.oom_kills += 1
        if kind == "bad_reply":
            sub = classify_bad_reply(reason) or "other"
            self.bad_replies[sub] = self.bad_replies.get(sub, 0) + 1

    def respawned(self, kind: str) -> None:
        self.respawns[kind] = self.respawns.get(kind, 0) + 1

    def started(self, seconds: float) -> None:
        self.start_latency.observe(seconds)

    # ------------------------------------------------------------------ the live view
    def live(self) -> dict:
        """The figures ``top`` shows, as JSON (the ``status`` op's ``live``)."""
        batch_ms = [s * 1e3 for s in list(self.recent_batch_s)]
        env_ms = [s * 1e3 for s in list(self.recent_env_s)]
        return {
            "calls": self.calls + self.lane_calls,
            "lane_calls": self.lane_calls,
            "calls_per_s": self.recent_calls.rate(RATE_WINDOW_S, self.opened),
            "batch_p50_ms": percentile(batch_ms, 50),
            "batch_p99_ms": percentile(batch_ms, 99),
            "env_step_p50_ms": percentile(env_ms, 50),
            "env_step_p99_ms": percentile(env_ms, 99),
            "stragglers": self.stragglers,
            "crashes": sum(self.crashes.values()),
            "stragglers_1m": self.recent_stragglers.total(60),
            "crashes_1m": self.recent_crashes.total(60),
            "crash_reasons": dict(self.crashes),
            "oom_kills": self.oom_kills,
            "bad_replies": sum(self.bad_replies.values()),
            "respawns": sum(self.respawns.values()),
            "hard_resets": self.hard_resets,
        }


#: The most batch latencies one lane report may carry (the pool keeps its newest).
MAX_REPORTED_BATCHES = 4096


def read_lane_report(report: object) -> tuple[int, list[float]]:
    """Validate a pool's lane report, ``{"calls": int, "batch_s": [seconds, ...]}``: ``(calls, seconds)``.

    >>> read_lane_report({"calls": 8, "batch_s": [0.001, 0.002]})
    (8, [0.001, 0.002])
    """
    if not isinstance(report, dict):
        raise ValueError("report needs a 'lane' object")
    calls, seconds = report.get("calls"), report.get("batch_s")
    if type(calls) is not int or not 0 <= calls < 2**53:
        raise ValueError(f"lane 'calls' must be a non-negative int, got {str(calls)[:40]}")
    if (
        not isinstance(seconds, list)
        or len(seconds) > MAX_REPORTED_BATCHES
        or not all(type(x) in (int, float) and 0 <= x < 86400 for x in seconds)
    ):
        raise ValueError(f"lane 'batch_s' must be a list of at most {MAX_REPORTED_BATCHES} latencies in seconds")
    return calls, [float(x) for x in seconds]


def envs_by_state(sandboxes: Iterable) -> dict[str, int]:
    """Envs (not sandboxes) in each :class:`~boltzlabs_gym.worker.envproc.EnvState`: a sandbox
    of K envs counts K times. ``lent``: idle, its pipes held by a local pool's direct lane."""
    out: dict[str, int] = {}
    for env in list(sandboxes):
        state = env.state.value
        out[state] = out.get(state, 0) + env.count
    return out


class WorkerStats:
    """The worker's books: one :class:`SessionStats` per open session, plus worker-wide counts."""

    def __init__(self) -> None:
        self.sessions: dict[str, SessionStats] = {}
        self.uploads: dict[str, int] = {}  # result -> count: unpacked, cached, refused, error
        self.upload_bytes = 0
        self.auth_failures = 0  # written by the ZAP thread only

    def open(self, sid: str, n: int, envs_per_sandbox: int, mode: str) -> SessionStats:
        stats = self.sessions[sid] = SessionStats(sid, n, envs_per_sandbox, mode)
        return stats

    def close(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def upload(self, result: str, nbytes: int = 0) -> None:
        self.uploads[result] = self.uploads.get(result, 0) + 1
        self.upload_bytes += nbytes
