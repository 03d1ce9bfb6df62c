"""``/metrics``: the worker's books (:mod:`.stats`) as Prometheus metric families.

Imported only when a worker is asked for ``--metrics-port`` (``prometheus-client`` is the
``metrics`` extra). The figures are read at scrape time by a custom collector, on the HTTP
server's thread: the event loop never calls ``prometheus_client``, so a worker serving
``/metrics`` does on its step path exactly what one without does. Every family carries a
``worker`` label (the worker's first endpoint); the per-pool ones a ``session`` label too.

Reading the loop's state from another thread is safe without a lock: the loop only
replaces ints and adds dict keys, and this side copies each dict or list in one call.
PSS (a read of ``/proc/PID/smaps_rollup`` per process) is cached for :data:`PSS_CACHE_S`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import MetricsPortError
from ..extras import require
from . import pss as memory
from .envproc import EnvState
from .stats import BAD_REPLY_REASONS, CRASH_REASONS, LatencyBuckets, envs_by_state

__all__ = ["WorkerCollector", "serve_metrics"]

log = logging.getLogger("boltzlabs_gym.worker")

#: How long a PSS measurement is reused between scrapes (it reads every env's /proc files).
PSS_CACHE_S = 5.0
RESPAWN_REASONS = ("straggler", *CRASH_REASONS)


class WorkerCollector:
    """A ``prometheus_client`` collector of one :class:`~boltzlabs_gym.worker.router.Worker`."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.name = worker.endpoints[0] if worker.endpoints else str(os.getpid())
        self._pss: dict[str, tuple[float, int, int]] = {}  # sid -> (when, envs' PSS, template PSS)
        self._lock = threading.Lock()

    def describe(self) -> list:
        return []  # no fixed description: families depend on the sessions open at scrape time

    def collect(self) -> Iterator:
        # One scrape at a time: the HTTP server runs a thread per request, and two would share
        # the PSS cache (and do its work twice).
        with self._lock:
            yield from self._collect()

    def _collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        w, stats = self.worker, self.worker.stats
        fam: dict[str, Any] = {}

        def family(kind, name: str, doc: str, labels: list[str]):
            if name not in fam:
                fam[name] = kind(name, doc, labels=["worker", *labels])
            return fam[name]

        sessions = list(w.sessions.values())
        books = dict(stats.sessions)
        in_use = sum(len(s.envs) for s in sessions)
        family(
            GaugeMetricFamily, "boltzlabs_capacity_sandboxes", "Sandboxes this worker may host at once", []
        ).add_metric([self.name], w.capacity)
        family(GaugeMetricFamily, "boltzlabs_sandboxes_in_use", "Sandbox processes of open sessions", []).add_metric(
            [self.name], in_use
        )
        uploads = family(CounterMetricFamily, "boltzlabs_uploads", "Env archive uploads, by result", ["result"])
        counts = dict(stats.uploads)
        for result in ("unpacked", "cached", "refused", "error"):
            uploads.add_metric([self.name, result], counts.get(result, 0))
        family(CounterMetricFamily, "boltzlabs_upload_bytes", "Bytes of env archives received", []).add_metric(
            [self.name], stats.upload_bytes
        )
        family(
            CounterMetricFamily, "boltzlabs_auth_failures", "Clients refused by the CURVE allow-list", []
        ).add_metric([self.name], stats.auth_failures)
        family(GaugeMetricFamily, "boltzlabs_worker_pss_bytes", "PSS of the worker process itself", []).add_metric(
            [self.name], memory.pid_pss(os.getpid())
        )
        for session in sessions:
            book = books.get(session.sid)
            if book is None or session.closed:
                continue
            try:
                self._session(session, book, family, GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)
            except Exception:  # noqa: BLE001 - one session closing under us must not fail the scrape
                log.debug("metrics: session %s skipped", session.sid, exc_info=True)
        self._pss = {sid: v for sid, v in self._pss.items() if sid in books}
        yield from fam.values()

    def _session(self, session, book, family, gauge, counter, histogram) -> None:
        base = [self.name, session.sid]
        k = str(book.envs_per_sandbox)
        info = family(gauge, "boltzlabs_session_info", "One per open session (pool): its mode and layout", [
            "session", "mode", "envs_per_sandbox", "isolation"])  # fmt: skip
        info.add_metric([*base, book.mode, k, _isolation_level(session)], 1)
        states = family(
            gauge, "boltzlabs_envs", "Envs (not sandboxes) by state", ["session", "envs_per_sandbox", "state"]
        )
        by_state = envs_by_state(session.envs)
        for state in EnvState:
            states.add_metric([*base, k, state.value], by_state.get(state.value, 0))
        calls = family(counter, "boltzlabs_env_calls", "Env calls answered (steps, resets, ...), by route", [
            "session", "route"])  # fmt: skip
        calls.add_metric([*base, "worker"], book.calls)
        calls.add_metric([*base, "lane"], book.lane_calls)
        batch = family(histogram, "boltzlabs_batch_latency_seconds", "Batch latency: fan-out to the envs and back", [
            "session", "route"])  # fmt: skip
        _add_histogram(batch, [*base, "worker"], book.batch_latency)
        _add_histogram(batch, [*base, "lane"], book.lane_batch_latency)
        step = family(histogram, "boltzlabs_env_step_latency_seconds",
                      "One env's step latency, worker-routed steps, one sampled in 8", ["session"])  # fmt: skip
        _add_histogram(step, base, book.env_step_latency)
        start = family(histogram, "boltzlabs_env_start_seconds",
                       "Sandbox start-up: interpreter start and first answer", ["session"])  # fmt: skip
        _add_histogram(start, base, book.start_latency)
        family(
            counter, "boltzlabs_stragglers", "Envs cut off at their step deadline", ["session", "reason"]
        ).add_metric([*base, "deadline"], book.stragglers)
        crashes = family(counter, "boltzlabs_crashes", "Envs whose sandbox failed, by reason", ["session", "reason"])
        by_reason = dict(book.crashes)
        for reason in CRASH_REASONS:
            crashes.add_metric([*base, reason], by_reason.get(reason, 0))
        family(
            counter, "boltzlabs_oom_kills", "Sandboxes killed by the OOM killer at their memory limit", ["session"]
        ).add_metric(base, book.oom_kills)
        bad = family(counter, "boltzlabs_bad_replies", "Sandboxes that broke the pipe protocol", ["session", "reason"])
        by_reason = dict(book.bad_replies)
        for reason in BAD_REPLY_REASONS:
            bad.add_metric([*base, reason], by_reason.get(reason, 0))
        respawns = family(counter, "boltzlabs_respawns", "Sandboxes restarted after a fault", ["session", "reason"])
        by_reason = dict(book.respawns)
        for reason in RESPAWN_REASONS:
            respawns.add_metric([*base, reason], by_reason.get(reason, 0))
        family(counter, "boltzlabs_hard_resets", "Envs restarted by reset(hard=True)", ["session"]).add_metric(
            base, book.hard_resets
        )
        envs_pss, template_pss = self._session_pss(session)
        family(
            gauge, "boltzlabs_session_pss_bytes", "PSS of the session's sandboxes and boltz template", ["session"]
        ).add_metric(base, envs_pss + template_pss)
        family(
            gauge, "boltzlabs_env_pss_bytes", "PSS per env (a sandbox's shared by its envs)", ["session"]
        ).add_metric(base, (envs_pss + template_pss) / max(1, book.n))
        total_gib = (envs_pss + template_pss) / 2**30
        family(gauge, "boltzlabs_envs_per_gib", "Envs per GiB of PSS", ["session"]).add_metric(
            base, book.n / total_gib if total_gib else 0.0
        )

    def _session_pss(self, session) -> tuple[int, int]:
        now = time.monotonic()
        cached = self._pss.get(session.sid)
        if cached is not None and now - cached[0] < PSS_CACHE_S:
            return cached[1], cached[2]
        pids = []
        for env in list(session.envs):
            launched = env.launched  # read once: the loop may clear it meanwhile
            if launched is not None:
                pids.append(launched.pid)
        total = sum(memory.trees_pss(pids))
        try:
            template = int(getattr(session.backend, "pss", lambda: 0)())
        except Exception:  # noqa: BLE001 - a template restarting under us
            template = 0
        self._pss[session.sid] = (now, total, template)
        return total, template


def _add_histogram(metric, labels: list[str], buckets: LatencyBuckets) -> None:
    cumulative = buckets.cumulative()
    metric.add_metric(labels, cumulative, sum_value=buckets.total)


def _isolation_level(session) -> str:
    try:
        return str(session.backend.report().backend)
    except Exception:  # noqa: BLE001
        return "unknown"


def serve_metrics(worker: Any, port: int, host: str = "127.0.0.1") -> str:
    """Serve ``worker``'s ``/metrics`` on ``host:port`` (0: a free port) from a daemon thread; its URL.

    Raises :class:`~boltzlabs_gym.errors.MetricsPortError` when the port cannot be bound and
    :class:`~boltzlabs_gym.errors.MissingExtraError` without ``prometheus-client``.
    """
    require("prometheus_client", "metrics", "--metrics-port")
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
        worker.metrics_server = server  # shut down with the worker (Worker.shutdown)
    except OSError as exc:
        raise MetricsPortError(
            f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc} (is another worker or exporter "
            "using that port? choose another --metrics-port / metrics_port, or 0 for a free one)",
            port=port,
            host=host,
        ) from None
    return f"http://{host}:{server.server_port}/metrics"
