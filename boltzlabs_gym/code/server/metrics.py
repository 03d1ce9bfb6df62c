"""The code server's Prometheus families (``GET /metrics``; needs ``prometheus-client``, the ``metrics`` extra).

* ``boltzlabs_code_runs_total{language,status}``: finished runs by language and run status
  (Success / Failed / SandboxError);
* ``boltzlabs_code_timeouts_total{language}``: runs that hit ``run_timeout``;
* ``boltzlabs_code_oom_kills_total{language}``: runs killed by SIGKILL before their deadline
  (the sandbox's memory limit kills that way);
* ``boltzlabs_code_queue_wait_seconds``: time from arrival to a lane taking the run (histogram);
* ``boltzlabs_code_run_seconds{language}``: time from arrival to the answer (histogram);
* ``boltzlabs_code_rejected_total{reason}``: requests turned away: ``unauthorized`` (no valid
  token, answered 401), ``queue_full`` (all clients' bound), ``client_queue_full`` (the client's
  own bound), ``language``;
* ``boltzlabs_code_cancelled_total``: runs whose client went away first;
* ``boltzlabs_code_queued`` / ``boltzlabs_code_running``: gauges read at scrape time;
* ``boltzlabs_code_wipe_in_force``: 1 where programs are wiped away in place between runs, 0 where
  every run is followed by a hard reset (turned off, or the wipe cannot run here: ``/v1/status`` says why).
"""

from __future__ import annotations

from collections.abc import Callable

from ..runs import RunRequest, RunResult

__all__ = ["ServerMetrics"]


class ServerMetrics:
    """The families above in a registry of their own; ``depth()`` gives ``(queued, running)`` and
    ``wipe_in_force()`` whether the wipe is in force, each at scrape time."""

    def __init__(self, depth: Callable[[], tuple[int, int]], *, wipe_in_force: Callable[[], bool] = lambda: True):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.runs = Counter("boltzlabs_code_runs", "Finished runs", ["language", "status"], registry=r)
        self.timeouts = Counter("boltzlabs_code_timeouts", "Runs that hit run_timeout", ["language"], registry=r)
        self.oom_kills = Counter(
            "boltzlabs_code_oom_kills", "Runs SIGKILLed before their deadline (memory limit)", ["language"], registry=r
        )
        self.queue_wait = Histogram(
            "boltzlabs_code_queue_wait_seconds",
            "Arrival to a lane taking the run",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )
        self.latency = Histogram(
            "boltzlabs_code_run_seconds",
            "Arrival to answer",
            ["language"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.rejected = Counter("boltzlabs_code_rejected", "Requests turned away", ["reason"], registry=r)
        self.cancelled = Counter("boltzlabs_code_cancelled", "Runs whose client went away first", registry=r)
        queued = Gauge("boltzlabs_code_queued", "Runs waiting for a lane", registry=r)
        running = Gauge("boltzlabs_code_running", "Runs in a lane's batch", registry=r)
        wipe = Gauge("boltzlabs_code_wipe_in_force", "1: programs wiped in place; 0: hard reset after each", registry=r)
        wipe.set_function(lambda: int(wipe_in_force()))  # (read at scrape time: lanes may start later)
        queued.set_function(lambda: depth()[0])
        running.set_function(lambda: depth()[1])

    def observe(self, request: RunRequest, result: RunResult, queue_wait_s: float, total_s: float) -> None:
        """Count one finished run."""
        self.runs.labels(request.language, result.status).inc()
        run = result.run_result
        if run is not None and run.status == "TimeLimitExceeded":
            self.timeouts.labels(request.language).inc()
        elif run is not None and run.return_code == -9:
            self.oom_kills.labels(request.language).inc()
        self.queue_wait.observe(queue_wait_s)
        self.latency.labels(request.language).observe(total_s)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
