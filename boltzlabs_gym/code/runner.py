"""Run untrusted programs on a pool: every program in a sandbox no earlier program touched.

:class:`CodeRunner` keeps ``lanes`` pools (:class:`~boltzlabs_gym.RLPool`, ``mode="boltz"``) of
the runner's env (``boltzlabs_gym/code/runner_env``). Requests wait in one queue; each env of a
lane that is free takes the next one (requests that wait while several envs are free go out
together, one message per worker), runs it and hands its result back as soon as its own program
ended: envs do not wait for each other (the pool's send/recv, through
:class:`~boltzlabs_gym.client.env_calls.EnvCalls`), so a program that runs into its
``run_timeout`` holds up its own env only. Between two programs an env is either *wiped* inside
its sandbox, before it answers (where it is PID 1 of its own PID namespace: every process left is
killed, every writable place emptied, SysV IPC removed, and the env checks that nothing is left
and that nothing of it changed; see ``docs/code-server.md``), or, where it cannot be or the wipe
found something, *hard-reset*: its process tree killed, its workspace wiped, a fresh env forked
from the warm template; only then does it take the next request.

The queue is fair between clients (:mod:`~boltzlabs_gym.code.fair_queue`): :meth:`CodeRunner.submit`
takes a ``client=`` key, every client waits in a line of its own, and the lanes take from the lines
in turn, so one client's burst waits behind the others' requests instead of starving them.

Pools are local by default; ``workers=`` (addresses or a
:class:`~boltzlabs_gym.client.sources.WorkerSource` such as ``boltzlabs_gym.ray.RayWorkers``) and
every pool setting (:class:`~boltzlabs_gym.client.options.PoolOptions`, as ``options=`` or
keywords) pass through, so the same runner runs on remote or Ray workers; ``lane_workers=`` puts
each lane on workers of its own (one lane per worker: what :mod:`boltzlabs_gym.code.placement` does).

A lane whose pool loses its worker (found lost within ``heartbeat_timeout``, or the pool failed) is
*lost*: its runs in flight end as ``SandboxError`` runs naming the loss, it takes no more requests
(the other lanes serve them), and its pool is closed once its runs ended. :meth:`CodeRunner.add_lane`
puts a lane on a worker that took the lost one's place (:class:`~boltzlabs_gym.code.placement.LaneKeeper`
does it for Ray); with no lane left serving, requests are answered ``SandboxError`` at once.

Limits: ``run_timeout`` is enforced inside the sandbox (the program's process group is killed
on it; the wipe or hard reset after it kills anything that left the group). ``memory_limit_mb``:
where the sandboxes have cgroups, the worker lowers the sandbox's cgroup limit for the run to what
the sandbox holds plus that much (never above the sandbox's own limit, ``limits``), and the kernel
OOM-kills a program past it (return code -9); elsewhere it becomes the program's
``RLIMIT_AS``/``RLIMIT_DATA``, as SandboxFusion sets it (:attr:`CodeRunner.memory_limit_by` says
which). Output is cut at ``max_output_bytes`` per stream (:attr:`CommandResult.truncated` says
how much was cut).

:meth:`CodeRunner.cancel` (and cancelling an :class:`AsyncCodeRunner` task) drops a queued run
and kills a running one's sandbox at once, through the worker's ``cancel`` op.

Usage (needs a worker and its sandboxes, so not run as a doctest)::

    with CodeRunner(envs_per_lane=4, lanes=2) as runner:
        r = runner.run("print(input()[::-1])", stdin="abc")
        r.status, r.run_result.stdout                      # ('Success', 'cba\\n')
        rs = runner.run_many([{"code": "print(1)"}, {"code": "echo hi", "language": "bash"}])
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Unpack

from ..client.env_calls import EnvCalls
from ..client.options import PoolOptions, PoolSettings
from ..client.pool import RLPool
from ..client.results import read_reset, read_step
from ..client.sources import WorkerSource
from ..errors import SandboxUnavailable, WorkerError
from ..wire.protocol import CALL_MEMORY_LIMIT, CALL_TAG
from .fair_queue import DEFAULT_CLIENT, FairQueue, QueueClosedError, QueueFullError
from .judges import Grade, assert_requests, judge_asserts, judge_stdio, stdio_requests
from .languages import NOT_SERVED, canonical, program_python, runtime_dir
from .runs import LANGUAGES, RunRequest, RunResult

#: How an env's report starts where it could not run a Python program in fresh namespaces (its
#: ``runner_env/env.py`` says so; the env dir is not importable as a package)
NO_FRESH = "no fresh namespaces for this env's programs"

log = logging.getLogger("boltzlabs_gym.code")

__all__ = [
    "RUNNER_ENV_DIR",
    "AsyncCodeRunner",
    "CodeRunner",
    "LaneReport",
    "QueueFullError",
    "RunnerSettings",
    "RunnerStats",
]

#: The runner's env directory (served in ``mode="boltz"``).
RUNNER_ENV_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner_env")


#: How often a lane that waits for a request looks whether it was lost (seconds).
LOST_LANE_POLL_S = 1.0


class _Lost:
    """What a lost lane's wait for a request ends with."""


@dataclass
class _Lane:
    """One lane: its pool, the calls on its envs, its envs free to take a program, its thread."""

    number: int
    pool: RLPool
    calls: EnvCalls
    where: str  # what the lane report says of its workers
    free: queue.SimpleQueue[int] = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None
    lost: str | None = None  # why it takes no more programs (its worker was lost, its pool failed)
    runs: int = 0  # programs it ran to their end (under ``_stats_lock``)


@dataclass(frozen=True)
class LaneReport:
    """One lane as :meth:`CodeRunner.lanes` reports it: its number, where it runs (``where``: the
    workers' description, ``local`` for a worker of its own; ``workers``: their addresses), its
    envs, the programs it ran, and, for a lane that takes no more requests, why (``lost``)."""

    number: int
    where: str
    workers: tuple[str, ...]
    envs: int
    runs: int = 0
    lost: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as ``/v1/status`` serves it."""
        out: dict[str, Any] = {"lane": self.number, "where": self.where, "workers": list(self.workers)}
        out.update(envs=self.envs, runs=self.runs, state="serving" if self.lost is None else "lost")
        if self.lost is not None:
            out["lost"] = self.lost
        return out


@dataclass
class _Job:
    request: RunRequest
    future: concurrent.futures.Future
    enqueued: float = field(default_factory=time.perf_counter)
    taken: float = 0.0
    tag: int = 0  # its step's tag on the wire: what a cancel names
    cancelled: bool = False  # cancelled while it ran: its result is dropped
    client: str = DEFAULT_CLIENT  # whose line it waits in (and goes back to, if a lost lane took it)


@dataclass
class RunnerStats:
    """Counters a runner keeps (read :meth:`CodeRunner.stats`); a listener sees every run as it ends."""

    runs: dict[tuple[str, str], int] = field(default_factory=dict)  # (language, status) -> count
    timeouts: int = 0
    oom_kills: int = 0  # runs killed by SIGKILL before their deadline: the memory limit's kill
    cancelled: int = 0
    queue_wait_s: float = 0.0
    queued: int = 0  # waiting runs, all clients together
    running: int = 0
    wipes: int = 0  # programs after which the env wiped itself clean
    fresh: int = 0  # programs that ran in fresh namespaces of their own (wipe=False): nothing to wipe or reset
    hard_resets: int = 0  # programs after which the env was hard-reset (no wipe here, or it found something)
    queued_by_client: dict[str, int] = field(default_factory=dict)  # waiting runs per client (those with any)
    lanes_lost: int = 0  # lanes that lost their worker (or whose pool failed) and took no more requests


def _program_python(python: str | None) -> str | None:
    """The interpreter a runner's ``python`` argument names (see :class:`CodeRunner`)."""
    if python != "auto":
        return python
    found = program_python()
    if found is None:
        log.info(
            "code runner: Python programs run under the worker's own interpreter: no code runtime at %s "
            "(boltzlabs-gym code-runtime install makes one, with its packages)",
            runtime_dir(),
        )
    return found


class CodeRunner:
    """Runs programs (python, bash, cpp, nodejs) in sandboxes of ``lanes`` pools; thread-safe.

    Args:
        envs_per_lane: sandboxes per pool; a lane runs up to that many programs at a time.
        lanes: pools (each with a thread that sends and receives its programs).
        workers: where every lane's :class:`~boltzlabs_gym.RLPool` runs (default: a local worker each).
        options, **settings: every lane's pool settings, as for :class:`~boltzlabs_gym.RLPool`
            (:class:`~boltzlabs_gym.client.options.PoolOptions`); the runner sets ``mode="boltz"``
            and ``step_timeout`` itself (keywords for them raise ``TypeError``), and takes
            ``envs_per_sandbox=1`` only. :attr:`pool_options` holds what its pools run with.
        max_run_timeout, max_compile_timeout: the largest ``run_timeout``/``compile_timeout`` a
            request may ask for (the pools' step deadline is sized from them).
        max_output_bytes: stdout and stderr kept per command; the rest is dropped and counted.
        max_queue: requests waiting at most, over all clients; past it :meth:`submit` raises
            :class:`QueueFullError`.
        max_queue_per_client: requests waiting at most for one client (``None``: ``max_queue``
            only); past it that client's :meth:`submit` raises :class:`QueueFullError` while
            others still get in.
        on_result: called with ``(request, result, queue_wait_s, total_s)`` on a lane's calls thread
            after every run (seconds from submission to an env taking it, and to its result).
        wipe: between programs, wipe an env inside its sandbox where that is sound (the default).
            ``False``: nothing is wiped; each program runs in namespaces and tmpfs places made for
            it alone, by a process cloned from a zygote that never saw a request (a Python program
            forked by it, any other compiled and run by it with its toolchain), where the sandbox
            allows it: the namespaces backend; the pools then let their envs make user namespaces
            (``nested_user_namespaces``). Where that cannot be, every program is followed by a hard
            reset.
        python: the interpreter Python programs (and ``pytest``) run under, by absolute path:
            ``"auto"`` takes the code runtime's venv (``boltzlabs-gym code-runtime install``),
            where this host has it, with its packages and a warm template of its own, else the
            worker's own interpreter (saying so once in the log); ``None``: the worker's own. An
            ``env_python`` pool setting wins over it.
        lane_workers: where each lane's pool runs, one entry per lane (addresses or a
            :class:`~boltzlabs_gym.client.sources.WorkerSource`), instead of ``lanes`` lanes on
            ``workers``: a lane on one worker is lost alone when that worker is
            (:func:`~boltzlabs_gym.code.placement.lanes_on_workers` makes such a list).

    :attr:`on_lane_lost`, if set, is called with a lane's number and why, once, when the lane is
    found lost (on the thread that found it; keep it short).
    """

    def __init__(
        self,
        envs_per_lane: int = 4,
        lanes: int = 2,
        *,
        workers: Sequence[str] | WorkerSource | None = None,
        options: PoolOptions | None = None,
        max_run_timeout: float = 60.0,
        max_compile_timeout: float = 60.0,
        max_output_bytes: int = 1 << 20,
        max_queue: int = 1024,
        max_queue_per_client: int | None = None,
        on_result: Callable[[RunRequest, RunResult, float, float], None] | None = None,
        wipe: bool = True,
        python: str | None = "auto",
        lane_workers: Sequence[Sequence[str] | WorkerSource | None] | None = None,
        **settings: Unpack[PoolSettings],
    ):
        if envs_per_lane < 1 or lanes < 1:
            raise ValueError(f"envs_per_lane and lanes must be >= 1, got {envs_per_lane} and {lanes}")
        if lane_workers is not None and (workers is not None or not lane_workers):
            raise ValueError("lane_workers gives each lane's workers (at least one lane): pass it without workers=")
        own = sorted(set(settings) & {"mode", "step_timeout"})
        if own:
            raise TypeError(
                f"CodeRunner sets {' and '.join(own)} itself (mode='boltz'; step_timeout from "
                "max_run_timeout and max_compile_timeout)"
            )
        pool_options = PoolOptions.fold(options, settings)
        if pool_options.envs_per_sandbox != 1:
            raise ValueError("CodeRunner runs each program in a sandbox of its own: envs_per_sandbox must be 1")
        self.envs_per_lane = envs_per_lane
        self.max_run_timeout = float(max_run_timeout)
        self.max_compile_timeout = float(max_compile_timeout)
        step_timeout = self.max_run_timeout + self.max_compile_timeout + 15.0
        #: The interpreter Python programs run under (None: the worker's own).
        self.python = pool_options.env_python or _program_python(python)
        #: The settings every lane's pool runs with.
        self.pool_options = dataclasses.replace(
            pool_options,
            mode="boltz",
            step_timeout=step_timeout,
            env_python=self.python,
            nested_user_namespaces=pool_options.nested_user_namespaces or not wipe,
        )
        self.max_output_bytes = int(max_output_bytes)
        self.on_result = on_result
        self.wipe = bool(wipe)
        self._stats = RunnerStats()
        self._stats_lock = threading.Lock()
        self._queue: FairQueue[_Job] = FairQueue(
            int(max_queue), int(max_queue_per_client) if max_queue_per_client is not None else None
        )
        self._tags = itertools.count(1)
        #: The runs in flight: their pool and env index (under ``_stats_lock``).
        self._running: dict[concurrent.futures.Future, tuple[_Lane, int, _Job]] = {}
        #: Held by a cancel from its look at ``_running`` to the worker's answer, and by a lane while it
        #: lets go of a finished run: a lane never starts an env's next run while the env is being
        #: killed for the last one (a lent env is killed whatever it runs).
        self._cancel_lock = threading.Lock()
        self._closed = False
        self.on_lane_lost: Callable[[int, str], None] | None = None
        self._last_loss = ""
        self._lanes: list[_Lane] = []  # (under ``_stats_lock``) a lost lane leaves once its pool closed
        self._numbers = itertools.count()
        #: Why programs are hard-reset after every run although ``wipe`` was asked for (the envs'
        #: own report at start-up: the isolation gives them no PID namespace of their own, or a
        #: wipe of a fresh sandbox failed), else ``None``. (Set before the lanes open: each
        #: lane's start-up reset, a lane added later too, reads the report.)
        self.wipe_unavailable: str | None = None
        #: Without the wipe: why programs are hard-reset after every run rather than run in
        #: fresh namespaces of their own (the envs' report at start-up), else ``None``.
        self.fresh_unavailable: str | None = None
        #: what the first env's trial program found (an integer: see ``runner_env/_recursion.py``), passed
        #: to every env forked after a hard reset, whose zygote then runs no trial of its own
        self._fresh_calibration: int | None = None
        #: each language SandboxFusion names -> None where the envs can run it, else why not
        #: (their toolchain is missing, say); read from the first lane's envs at start-up
        self.languages: dict[str, str | None] = {}
        places = list(lane_workers) if lane_workers is not None else [workers] * lanes
        try:
            for where in places:
                self._lanes.append(self._open_lane(where))
        except BaseException:
            self.close()
            raise
        #: The isolation every program runs under (the first pool's report; all pools ask for the same).
        self.isolation = self._lanes[0].pool.isolation
        self._isolation_text = self.isolation.backend if self.isolation is not None else ""
        memory = str(self.isolation.properties.get("memory_limit", "")) if self.isolation is not None else ""
        #: How a request's ``memory_limit_mb`` is enforced: ``"cgroup v1"``/``"cgroup v2"`` (the
        #: sandbox's cgroup, lowered for the run by its worker) or ``"rlimit"`` (``RLIMIT_AS``/``RLIMIT_DATA``).
        self.memory_limit_by = memory if memory.startswith("cgroup") else "rlimit"
        for lane in self._lanes:
            self._start_lane(lane)

    @property
    def fresh_in_force(self) -> bool:
        """Whether, without the wipe, programs run in fresh namespaces of their own (no hard
        reset after them): ``wipe=False`` and possible here (no :attr:`fresh_unavailable`)."""
        return not self.wipe and self.fresh_unavailable is None

    @property
    def wipe_in_force(self) -> bool:
        """Whether programs are wiped away in place between runs: asked for (``wipe``) and possible
        here (no :attr:`wipe_unavailable`); else every run is followed by a hard reset."""
        return self.wipe and self.wipe_unavailable is None

    def _note_languages(self, observations: Sequence[Any]) -> None:
        """Read which languages the first lane's envs can run (their sandbox's toolchains)."""
        if self.languages:
            return
        for obs in observations:
            if isinstance(obs, Mapping) and isinstance(obs.get("languages"), Mapping):
                self.languages = {str(k): None if v is None else str(v) for k, v in obs["languages"].items()}
                missing = sorted(k for k, v in self.languages.items() if v is not None and k not in NOT_SERVED)
                if missing:
                    log.info(
                        "code runner: these languages cannot run here: %s (see `boltzlabs-gym code-languages`)",
                        ", ".join(missing),
                    )
                return

    def _note_wipe(self, observations: Sequence[Any]) -> None:
        """Read the envs' start-up report; warn once where the wipe asked for (or, without it, fresh
        namespaces per program) cannot run."""
        if not self.wipe:
            self._note_fresh(observations)
            return
        if self.wipe_unavailable is not None:
            return
        self.wipe_unavailable = _first_refusal(observations, "wipe", "no_wipe")
        if self.wipe_unavailable is not None:
            log.warning(
                "code runner: programs will be hard-reset (killed and forked afresh) after every run, not wiped "
                "in place: %s",
                self.wipe_unavailable,
            )

    def _note_fresh(self, observations: Sequence[Any]) -> None:
        for obs in observations:
            found = obs.get("fresh_calibration") if isinstance(obs, Mapping) else None
            if type(found) is int and self._fresh_calibration is None:
                self._fresh_calibration = found
        if self.fresh_unavailable is not None:
            return
        self.fresh_unavailable = _first_refusal(observations, "fresh", "no_fresh")
        if self.fresh_unavailable is not None:
            log.warning(
                "code runner: without the wipe, every program will be hard-reset (killed and forked afresh) "
                "after its run, not run in fresh namespaces of its own: %s",
                self.fresh_unavailable,
            )

    # ------------------------------------------------------------------ asking
    def submit(
        self, request: RunRequest | Mapping[str, Any] | str, *, client: str = DEFAULT_CLIENT
    ) -> concurrent.futures.Future:
        """Queue one program in ``client``'s line; a future of its :class:`RunResult`. Cancelling
        the future before a lane takes it drops the run. With no lane serving (every lane's worker
        lost), the future holds a ``SandboxError`` run at once.

        Raises:
            ValueError: the request asks for a language or timeout this runner does not run.
            QueueFullError: ``max_queue`` requests wait already, or ``max_queue_per_client`` of
                ``client``'s.
        """
        request = self._check(RunRequest.of(request))
        future: concurrent.futures.Future = concurrent.futures.Future()
        job = _Job(request, future, tag=next(self._tags), client=client)
        with self._stats_lock:  # (a lane found lost drains the queue under it: nothing slips in between)
            unserved = self._unserved()
            if unserved is None:
                try:
                    self._queue.put(client, job)
                except QueueClosedError:
                    raise RuntimeError("this CodeRunner is closed") from None
        if unserved is not None:
            self._answer_unserved(job, unserved)
        return future

    def cancel(self, future: concurrent.futures.Future) -> bool:
        """Cancel a run :meth:`submit` started: dropped if no env took it yet; if it runs, its
        env's whole sandbox (the program's process tree with it) is killed at once and reset
        before its next program. The future then raises ``CancelledError``. ``False``: it had
        finished (or was cancelled before)."""
        if future.cancel():
            # Out of its line at once, so it holds no place under the queue's bounds; if a lane
            # has just taken it, the lane finds it cancelled and counts it.
            if self._queue.remove(lambda job: job.future is future) is not None:
                with self._stats_lock:
                    self._stats.cancelled += 1
            return True
        with self._cancel_lock:
            with self._stats_lock:
                running = self._running.get(future)
                if running is None or running[2].cancelled:
                    return False
                lane, index, job = running
                job.cancelled = True
                self._stats.cancelled += 1
            if lane.lost is not None:
                return True  # its worker is gone (and its sandbox with it): nothing to kill, nobody to ask
            try:
                lane.pool.cancels.cancel([(index, job.tag)], lent=True)
            except Exception:  # the run then ends by its own deadline; its result is dropped
                log.exception("code runner could not cancel a run in flight")
        return True

    def run(self, code: str, language: str = "python", **fields: Any) -> RunResult:
        """Run one program and wait for it: ``stdin``, ``files``, ``fetch_files``, ``run_timeout``,
        ``compile_timeout``, ``memory_limit_mb`` as in :class:`RunRequest`."""
        return self.submit(RunRequest(code=code, language=language, **fields)).result()

    def run_many(self, requests: Iterable[RunRequest | Mapping[str, Any] | str]) -> list[RunResult]:
        """Run several programs at once (queued together: they go out together to the free envs,
        the rest as envs come free) and return their results in order."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def grade_stdio(self, code: str, inputs: list[str], outputs: list[str | None], **fields: Any) -> Grade:
        """Run ``code`` once per stdin in ``inputs``; a case passes when the run succeeds and its
        stdout equals the expected one up to trailing newlines (``None``: any output), as verl's
        sandbox-fusion reward compares them."""
        return judge_stdio(self.run_many(stdio_requests(code, inputs, **fields)), outputs)

    def grade_asserts(self, code: str, asserts: list[str], **fields: Any) -> Grade:
        """Run ``code`` followed by each assert case (one program per case); a case passes when its
        program succeeds (exit status 0)."""
        return judge_asserts(self.run_many(assert_requests(code, asserts, **fields)))

    def _check(self, request: RunRequest) -> RunRequest:
        # (a field of the wrong type would fail the lane's JSON encoding: refuse it here instead)
        if not isinstance(request.code, str) or not isinstance(request.stdin, (str, type(None))):
            raise TypeError(
                f"code and stdin must be strings, got {type(request.code).__name__} and {type(request.stdin).__name__}"
            )
        if canonical(request.language) not in LANGUAGES:
            raise ValueError(f"language {request.language!r} is not supported; supported: {', '.join(LANGUAGES)}")
        if not 0 < float(request.run_timeout) <= self.max_run_timeout:
            raise ValueError(f"run_timeout must be in (0, {self.max_run_timeout:g}] s, got {request.run_timeout}")
        if not 0 < float(request.compile_timeout) <= self.max_compile_timeout:
            raise ValueError(
                f"compile_timeout must be in (0, {self.max_compile_timeout:g}] s, got {request.compile_timeout}"
            )
        return request

    # ------------------------------------------------------------------ what the runner knows
    def stats(self) -> RunnerStats:
        """A copy of the counters."""
        depths = self._queue.depths()
        with self._stats_lock:
            s = self._stats
            return RunnerStats(
                dict(s.runs), s.timeouts, s.oom_kills, s.cancelled, s.queue_wait_s, sum(depths.values()), s.running,
                s.wipes, s.fresh, s.hard_resets, depths, s.lanes_lost,
            )  # fmt: skip

    @property
    def max_queue(self) -> int:
        """Requests waiting at most, over all clients (may be changed while the runner runs)."""
        return self._queue.max_total or 0

    @max_queue.setter
    def max_queue(self, value: int) -> None:
        self._queue.max_total = int(value)

    @property
    def max_queue_per_client(self) -> int | None:
        """Requests waiting at most for one client; ``None``: only :attr:`max_queue` bounds them."""
        return self._queue.max_per_client

    @max_queue_per_client.setter
    def max_queue_per_client(self, value: int | None) -> None:
        self._queue.max_per_client = int(value) if value is not None else None

    @property
    def capacity(self) -> int:
        """Programs that can run at the same time (envs over the lanes that serve)."""
        with self._stats_lock:
            return sum(lane.pool.n for lane in self._lanes if lane.lost is None)

    def lanes(self) -> list[LaneReport]:
        """Each lane (serving, or lost and not closed yet): where it runs, its envs, whether it serves."""
        with self._stats_lock:
            lanes = [(la, la.runs) for la in self._lanes]
        return [LaneReport(la.number, la.where, tuple(la.pool.workers), la.pool.n, runs, la.lost) for la, runs in lanes]

    # ------------------------------------------------------------------ the lanes
    def add_lane(self, workers: Sequence[str] | WorkerSource | None = None, *, where: str | None = None) -> int:
        """Start one more lane, its pool on ``workers`` (default: a local worker of its own), with the
        runner's pool settings; its number once it takes requests. ``where`` names its place in
        :meth:`lanes` (default: its workers' ``where``, or their addresses). For a lane in place of
        a lost one (:class:`~boltzlabs_gym.code.placement.LaneKeeper`). Raises what the pool's start
        raises, and :class:`~boltzlabs_gym.errors.SandboxUnavailable` if its isolation is not the
        runner's (nothing is left running then)."""
        lane = self._open_lane(workers, where)
        try:
            backend = lane.pool.isolation.backend if lane.pool.isolation is not None else ""
            if backend != self._isolation_text:
                raise SandboxUnavailable(
                    f"a lane on {lane.where} would run programs under isolation {backend!r}, this runner's "
                    f"lanes run under {self._isolation_text!r}: give its worker the same sandbox backend"
                )
            with self._stats_lock:
                if self._closed:
                    raise RuntimeError("this CodeRunner is closed")
                self._lanes.append(lane)
        except BaseException:
            lane.calls.close()
            lane.pool.close()
            raise
        self._start_lane(lane)
        log.info("code runner: lane %d on %s takes requests", lane.number, lane.where)
        return lane.number

    def retire_lane(self, number: int, reason: str) -> None:
        """Take lane ``number`` out of service (its worker is known lost, say): it takes no more
        requests, its runs in flight end as they end, then its pool closes. Nothing for a lane that
        is lost already or gone."""
        with self._stats_lock:
            lane = next((la for la in self._lanes if la.number == number), None)
        if lane is not None:
            self._mark_lost(lane, reason)

    def _open_lane(self, workers: Sequence[str] | WorkerSource | None, where: str | None = None) -> _Lane:
        """A lane's pool started, its envs reset, the calls on its envs running (no thread yet)."""
        pool = RLPool(RUNNER_ENV_DIR, self.envs_per_lane, workers=workers, options=self.pool_options)
        try:
            ready = pool.reset(options={**self._reset_options(), "languages": True})
            self._note_wipe(ready)
            self._note_languages(ready)
            calls = EnvCalls(pool, name=f"code-runner-calls-{id(pool):x}")
        except BaseException:
            pool.close()
            raise
        return _Lane(next(self._numbers), pool, calls, where or _where(workers))

    def _reset_options(self) -> dict[str, Any]:
        """What the envs are reset with: the wipe, or else fresh namespaces per program."""
        options: dict[str, Any] = {"wipe": self.wipe, "fresh": not self.wipe}
        if self._fresh_calibration is not None:
            options["fresh_calibration"] = self._fresh_calibration
        return options

    def _start_lane(self, lane: _Lane) -> None:
        for i in range(lane.pool.n):
            lane.free.put(i)
        lane.thread = threading.Thread(target=self._lane, args=(lane,), name=f"code-runner-lane-{lane.number}")
        lane.thread.daemon = True
        lane.thread.start()

    def _lane(self, lane: _Lane) -> None:
        """Keep the lane's envs busy: each env that is free takes the next waiting request, and
        comes back when its own program has ended and its sandbox is clean again (wiped, or
        hard-reset), whatever the lane's other envs are running. A lost lane stops taking requests
        (its runs in flight end as lost ones) and closes its pool."""
        free = lane.free
        while True:
            env = free.get()
            if lane.lost is not None:
                free.put(env)
                break
            started = self._take(lane, env)
            if not started and (self._closed or lane.lost is not None):
                break
            if started:
                self._start(lane, started)
        for _ in range(lane.pool.n):  # runs in flight (and hard resets) finish first
            try:
                free.get(timeout=self.max_run_timeout + self.max_compile_timeout + 30.0)
            except queue.Empty:
                log.error("code runner lane %d closed with programs still running", lane.number)
                return
        if lane.lost is not None and not self._closed:
            self._close_lost(lane)

    def _close_lost(self, lane: _Lane) -> None:
        """A lost lane's runs ended: close its pool (a lost worker's session is not waited for) and
        forget it."""
        _close_lane_pool(lane)
        with self._stats_lock:
            if lane in self._lanes:
                self._lanes.remove(lane)
        log.info("code runner: lost lane %d on %s closed", lane.number, lane.where)

    def _mark_lost(self, lane: _Lane, reason: str) -> None:
        """Lane ``lane`` takes no more requests; with none serving, the waiting ones are answered."""
        with self._stats_lock:
            if lane.lost is not None:
                return
            lane.lost = self._last_loss = reason
            self._stats.lanes_lost += 1
            unserved = self._unserved()
            stranded = self._drain_queue() if unserved is not None else []
        log.warning(
            "code runner: lane %d on %s is lost, it takes no more requests: %s", lane.number, lane.where, reason
        )
        for job in stranded:
            self._answer_unserved(job, unserved or reason)
        if self.on_lane_lost is not None:
            try:
                self.on_lane_lost(lane.number, reason)
            except Exception:
                log.exception("code runner on_lane_lost listener failed")

    def _unserved(self) -> str | None:
        """Why no lane can take a request (every lane lost), else ``None``; under ``_stats_lock``."""
        if self._closed or any(lane.lost is None for lane in self._lanes):
            return None
        return f"no sandbox is left to run it: every lane was lost, none has taken its place (last: {self._last_loss})"

    def _drain_queue(self) -> list[_Job]:
        """Take every waiting request out of the queue, in turn order (the queue stays open: a lane
        added later serves what comes next); under ``_stats_lock``."""
        jobs = []
        while (job := self._queue.get_nowait()) is not None:
            jobs.append(job)
        return jobs

    def _answer_unserved(self, job: _Job, why: str) -> None:
        """A request no lane can take gets a ``SandboxError`` run saying why (it never ran)."""
        if job.future.set_running_or_notify_cancel():
            job.taken = time.perf_counter()
            self._deliver(job, RunResult.sandbox_error(why, self._isolation_text), job.taken)
        else:
            with self._stats_lock:
                self._stats.cancelled += 1

    def _wait_for_request(self, lane: _Lane) -> _Job | _Lost | None:
        """The next waiting request in turn (``None``: the queue is closed); a lane found lost while
        it waits stops waiting (it looks every :data:`LOST_LANE_POLL_S`), to close its pool."""
        while True:
            try:
                return self._queue.get(timeout=LOST_LANE_POLL_S)
            except queue.Empty:
                if lane.lost is not None:
                    return _Lost()

    def _put_back(self, job: _Job) -> None:
        """A request a lost lane took before it knew: back at the head of its client's line, its
        client at the head of the round (:meth:`FairQueue.put_front`: the client keeps the turn the
        lost lane spent), for a lane that serves; with none serving, answered; at close, cancelled
        as the requests that waited were."""
        closed = False
        with self._stats_lock:
            if job.future.cancelled():  # while the lost lane held it, out of every line: counted here
                self._stats.cancelled += 1
                return
            unserved = self._unserved()
            if unserved is None:
                try:
                    self._queue.put_front(job.client, job)
                except QueueClosedError:
                    closed = True
        if closed:
            job.future.cancel()
        elif unserved is not None:
            self._answer_unserved(job, unserved)

    def _take(self, lane: _Lane, env: int) -> list[tuple[int, _Job]]:
        """Wait for a request for free ``env``; then give whatever else waits to the lane's other free
        envs (in the queue's turn order). ``(env, job)`` pairs; ``[]`` at close (or when every
        request taken was cancelled, or the lane was lost while it waited)."""
        free = lane.free
        first = self._wait_for_request(lane)
        if first is None:  # closed
            free.put(env)
            return []
        if isinstance(first, _Lost) or lane.lost is not None:
            if isinstance(first, _Job):
                self._put_back(first)
            free.put(env)
            return []
        pairs = [(env, first)]
        while True:
            try:
                env = free.get_nowait()
            except queue.Empty:
                break
            job = self._queue.get_nowait()
            if job is None:
                free.put(env)
                break
            pairs.append((env, job))
        now = time.perf_counter()
        live = []
        with self._stats_lock:
            for env, job in pairs:
                if job.future.set_running_or_notify_cancel():
                    job.taken = now
                    live.append((env, job))
                    self._stats.queue_wait_s += now - job.enqueued
                else:
                    self._stats.cancelled += 1
                    free.put(env)
            self._stats.running += len(live)
        return live

    def _start(self, lane: _Lane, pairs: list) -> None:
        """Send each job's program to its env (together: one message per worker); each ends on its own."""
        items = []
        for env, job in pairs:
            action = job.request.to_action(self.max_output_bytes)
            action["wipe"] = self.wipe
            op = {"op": "step", "action": action, CALL_TAG: job.tag}
            if action["memory_limit_mb"] > 0 and self.memory_limit_by != "rlimit":
                op[CALL_MEMORY_LIMIT] = action["memory_limit_mb"] << 20  # the worker lowers the cgroup's limit
                action["memory_limit_mb"] = -1  # and the program gets no rlimit
            items.append((env, op, ()))
        with self._stats_lock:
            self._running.update((job.future, (lane, env, job)) for env, job in pairs)
        try:
            futures = lane.calls.submit_many(items)
        except Exception as exc:  # noqa: BLE001 - the pool failed or closed: these runs are the sandbox's errors
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(exc)
            futures = [failed] * len(pairs)
        for (env, job), future in zip(pairs, futures):
            future.add_done_callback(functools.partial(self._ended, lane, env, job))

    def _ended(self, lane: _Lane, env: int, job: _Job, future: concurrent.futures.Future) -> None:
        """A program ended (on the lane's calls thread): its result out, then its env made clean and
        free (on a lost lane: free to close)."""
        result, clean = self._read(lane.pool, env, future)
        lost = self._loss_of(lane, future)
        if lost is not None:
            self._mark_lost(lane, lost)
            if result.status == "SandboxError":  # what failed it was the loss, not the sandbox
                result = RunResult.sandbox_error(
                    f"the worker running this program was lost: {lost}. Its outcome is unknown: run it again",
                    result.isolation,
                )
        now = time.perf_counter()
        with self._cancel_lock, self._stats_lock:
            self._running.pop(job.future, None)
            # a cancelled run's env was killed, maybe only after its program ended clean: reset it
            clean = clean and not job.cancelled
            self._stats.running -= 1
            lane.runs += not job.cancelled
            self._stats.wipes += clean and self.wipe
            self._stats.hard_resets += not clean and lane.lost is None  # (a lost lane's envs are not reset)
        if job.cancelled:
            job.future.set_exception(concurrent.futures.CancelledError())
        else:
            self._deliver(job, result, now)
        if clean or self._closed or lane.lost is not None:
            lane.free.put(env)
            return
        try:  # killed, wiped, forked afresh for the next program
            reset = lane.calls.submit(env, {"op": "hard_reset", "seed": None, "options": self._reset_options()})
        except Exception:
            log.exception("code runner lane could not hard-reset env %d", env)
            lane.free.put(env)
            return
        reset.add_done_callback(functools.partial(self._reset_done, lane, env))

    def _deliver(self, job: _Job, result: RunResult, now: float) -> None:
        """Count a finished run, tell the listener, resolve its future."""
        self._count(job.request, result)
        if self.on_result is not None:
            try:
                self.on_result(job.request, result, job.taken - job.enqueued, now - job.enqueued)
            except Exception:
                log.exception("code runner on_result listener failed")
        job.future.set_result(result)

    def _reset_done(self, lane: _Lane, env: int, future: concurrent.futures.Future) -> None:
        lost = self._loss_of(lane, future)
        if lost is not None:  # (the worker went while the env restarted)
            self._mark_lost(lane, lost)
        else:
            try:
                _, _, failure = read_reset(future.result().result, lane.pool.start_timeout)
                if failure is not None:
                    log.error("code runner: env %d did not restart after a hard reset: %s", env, failure.reason)
            except Exception:
                log.exception("code runner lane could not hard-reset env %d", env)
        lane.free.put(env)  # (one that did not restart reports a sandbox error for its next program)

    def _loss_of(self, lane: _Lane, future: concurrent.futures.Future) -> str | None:
        """Why ``lane`` can run no more programs, seen from a call of it that ended: its pool failed
        (a worker lost where losses raise, a local worker that died), or reports its worker lost;
        ``None`` while it serves (and at close, when its calls stop)."""
        if lane.lost is not None:
            return lane.lost
        if self._closed:
            return None
        error = future.exception()
        if isinstance(error, WorkerError):
            return str(error)  # (it names the worker)
        if error is not None:
            return f"its pool failed: {type(error).__name__}: {error}"
        lost = lane.pool.lost_workers
        if lost:
            # The pool's reason ends in advice to its own user (replace, hard-reset): the runner does that.
            return "; ".join(why.partition("; its envs are gone")[0] for why in lost.values())
        return None

    def _read(self, pool: RLPool, env: int, future: concurrent.futures.Future) -> tuple[RunResult, bool]:
        """A program's result, and whether its env is clean after it (wiped, or the program ran in
        fresh namespaces that died with it)."""
        try:
            finished = future.result()
        except Exception as exc:  # noqa: BLE001 - the pool itself failed: the run is the sandbox's error
            log.error("code runner lane: env %d: the pool failed: %s", env, exc)
            return RunResult.sandbox_error(f"the pool failed: {exc}", self._isolation_text), False
        t = read_step(finished.result, pool.step_timeout)
        if t.failure is not None:
            detail = f"{t.failure.reason}\n{t.failure.stderr}".strip()
            return RunResult.sandbox_error(f"the sandbox failed: {detail}", self._isolation_text), False
        obs = t.obs or {}
        clean = obs.get("clean") is True
        unclean = str(obs.get("unclean"))
        if unclean.startswith(NO_FRESH) and self.fresh_unavailable is None:
            # (an env forked after a hard reset, whose zygote could not be made at its reset)
            self.fresh_unavailable = unclean[len(NO_FRESH) + 2 :]
            log.warning(
                "code runner: env %d cannot run programs in fresh namespaces of their own (%s): its programs "
                "are hard-reset after their run",
                env,
                self.fresh_unavailable,
            )
        elif not clean and unclean != "not wiped (hard reset)" and not unclean.startswith(NO_FRESH):
            log.info("code runner: env %d not clean after a program (%s): hard reset", env, obs.get("unclean"))
        if clean and obs.get("fresh") is True:
            with self._stats_lock:
                self._stats.fresh += 1
        return RunResult.from_observation(obs, self._isolation_text), clean

    def _count(self, request: RunRequest, result: RunResult) -> None:
        run = result.run_result
        with self._stats_lock:
            key = (request.language, result.status)
            self._stats.runs[key] = self._stats.runs.get(key, 0) + 1
            if run is not None and run.status == "TimeLimitExceeded":
                self._stats.timeouts += 1
            elif run is not None and run.return_code == -9:
                self._stats.oom_kills += 1

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop the lanes (runs in flight finish first; queued ones are cancelled) and close the pools."""
        with self._stats_lock:
            if self._closed and not self._lanes:
                return
            self._closed = True
            lanes, self._lanes = self._lanes, []
        for job in self._queue.close():  # the lanes' waits end; a submit from now on is refused
            job.future.cancel()
        for lane in lanes:
            if lane.thread is not None:
                lane.thread.join(timeout=self.max_run_timeout + self.max_compile_timeout + 30.0)
        for lane in lanes:
            _close_lane_pool(lane)

    def __enter__(self) -> CodeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        lanes, k = self.capacity // self.envs_per_lane, self.envs_per_lane
        return f"CodeRunner(lanes={lanes}, envs_per_lane={k}, isolation={self._isolation_text!r})"


def _first_refusal(observations: Sequence[Any], said: str, why: str) -> str | None:
    """Why the first env whose start-up report has ``said`` false gave (its ``why``), or None where
    every one said yes."""
    for obs in observations:
        if isinstance(obs, Mapping) and not obs.get(said):
            return str(obs.get(why) or "the env did not say why")
    return None


def _close_lane_pool(lane: _Lane) -> None:
    """Stop the calls on a lane's envs and close its pool."""
    lane.calls.close()
    if lane.lost is not None:
        # Its calls to the lost worker never come back; that is known and was answered, and not
        # worth the pool's warning about calls dropped unreceived.
        lane.pool.async_steps.drop()
    lane.pool.close()


def _where(workers: Sequence[str] | WorkerSource | None) -> str:
    """What a lane report says of a lane's workers: a source's own ``where`` (a pinned Ray worker
    names its node), else their addresses; ``local`` for the lane's own worker."""
    if workers is None:
        return "local"
    where = getattr(workers, "where", None)
    if isinstance(where, str):
        return where
    addresses = workers.addresses if isinstance(workers, WorkerSource) else workers
    return ", ".join(addresses)


class RunnerSettings(PoolSettings, total=False):
    """:class:`CodeRunner`'s arguments as keywords, its own and the pool settings it passes on
    (``**settings: Unpack[RunnerSettings]``): what a face that starts a runner of its own
    (:class:`AsyncCodeRunner`, :class:`~boltzlabs_gym.integrations.grading.Grader`) takes and
    forwards. Same names and types as :class:`CodeRunner`'s parameters (a test holds them together)."""

    envs_per_lane: int
    lanes: int
    workers: Sequence[str] | WorkerSource | None
    options: PoolOptions | None
    max_run_timeout: float
    max_compile_timeout: float
    max_output_bytes: int
    max_queue: int
    max_queue_per_client: int | None
    on_result: Callable[[RunRequest, RunResult, float, float], None] | None
    wipe: bool
    python: str | None
    lane_workers: Sequence[Sequence[str] | WorkerSource | None] | None


class AsyncCodeRunner:
    """The asyncio face of a :class:`CodeRunner` (made with the same arguments, as keywords, or
    given one)::

    async with AsyncCodeRunner(envs_per_lane=4) as runner:
        result = await runner.run("print(1)")
        results = await runner.run_many(["print(2)", {"code": "echo 3", "language": "bash"}])
    """

    def __init__(self, *, runner: CodeRunner | None = None, **settings: Unpack[RunnerSettings]):
        if runner is not None and settings:
            raise TypeError(f"AsyncCodeRunner(runner=...) takes no settings of a new runner, got {sorted(settings)}")
        #: The synchronous runner doing the work.
        self.runner = runner if runner is not None else CodeRunner(**settings)

    async def submit(self, request: RunRequest | Mapping[str, Any] | str, *, client: str = DEFAULT_CLIENT) -> RunResult:
        """Run one request in ``client``'s line (as :meth:`CodeRunner.submit`); cancelling the
        awaiting task cancels it (:meth:`CodeRunner.cancel`)."""
        future = self.runner.submit(request, client=client)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            await asyncio.get_running_loop().run_in_executor(None, self.runner.cancel, future)
            raise

    async def run(self, code: str, language: str = "python", **fields: Any) -> RunResult:
        """As :meth:`CodeRunner.run`."""
        return await self.submit(RunRequest(code=code, language=language, **fields))

    async def run_many(self, requests: Iterable[RunRequest | Mapping[str, Any] | str]) -> list[RunResult]:
        """As :meth:`CodeRunner.run_many`."""
        return list(await asyncio.gather(*(self.submit(r) for r in requests)))

    async def grade_stdio(self, code: str, inputs: list[str], outputs: list[str | None], **fields: Any) -> Grade:
        """As :meth:`CodeRunner.grade_stdio`."""
        return judge_stdio(await self.run_many(stdio_requests(code, inputs, **fields)), outputs)

    async def grade_asserts(self, code: str, asserts: list[str], **fields: Any) -> Grade:
        """As :meth:`CodeRunner.grade_asserts`."""
        return judge_asserts(await self.run_many(assert_requests(code, asserts, **fields)))

    @property
    def isolation(self):
        """The isolation every program runs under."""
        return self.runner.isolation

    async def aclose(self) -> None:
        """Close the runner (in a thread: it waits for runs in flight)."""
        await asyncio.get_running_loop().run_in_executor(None, self.runner.close)

    async def __aenter__(self) -> AsyncCodeRunner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
