#!/usr/bin/env python
"""Side-by-side vector-env benchmark: Gymnasium, SB3, EnvPool, PufferLib and boltzlabs_gym.

    python benchmarks/run.py --suite quick|full|smoke [--out benchmarks/results] [--sizes 8,64,256]
    python benchmarks/run.py --suite full --sizes 64,256 --workloads cartpole --throughput-only \
        --impls sync,async,subproc,dummy,envpool,pufferlib,default,boltz --envs-per-sandbox 1,32

Writes ``latest.json`` (raw figures + machine info), ``latest.md`` (tables) and PNG plots
into ``--out``. Implementations are measured in one process, interleaved: every
repetition runs one timed block per implementation, in alternating order, so machine
drift spreads over all of them. Progress goes to stderr.

``--impls`` picks implementations by paired.py's short names (sync, async, subproc, dummy,
envpool, pufferlib; ours: default, process, boltz, each optionally ``-kK`` for
``envs_per_sandbox=K``), and ``--envs-per-sandbox 1,8,32`` runs each of ours at every K.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import select
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_envs  # noqa: E402
import cloudpickle  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import paired  # noqa: E402
import psutil  # noqa: E402

from boltzlabs_gym.testing import CODE_ENV_GOOD, CODE_ENV_WRONG  # noqa: E402

# SB3's SubprocVecEnv uses the forkserver start method; without a preload every worker
# re-imports torch (~150 MiB PSS, seconds of CPU each). Preload what its workers import,
# as a tuned training script would, so start-up and memory are not SB3 at its worst.
mp.set_forkserver_preload(["stable_baselines3.common.vec_env", "gymnasium", "numpy", "bench_envs"])
import stable_baselines3.common.vec_env  # noqa: E402,F401

# Workers (sandboxes, forkserver children) cannot import this directory: ship by value.
cloudpickle.register_pickle_by_value(bench_envs)

COUNTER_DIR = os.path.join(ROOT, "envs", "counter")
CODE_DIR = os.path.join(ROOT, "envs", "code_env")
HANG_DIR = os.path.join(HERE, "env_dirs", "hang_counter")

# --------------------------------------------------------------------------- suites
SUITES = {
    # tests/project/test_benchmarks.py: every implementation once, tiny.
    "smoke": dict(
        sizes=[4],
        steps={4: 40},
        warmup=5,
        reps=2,
        code_sizes=[2],
        code_steps=1,
        code_reps=1,
        floor_steps=200,
        straggler_n=2,
        hard_reset_n=2,
        hard_reset_reps=3,
        keep_alive_max_n=64,
        straggler_bound_s=1.0,
        step_timeout_s=0.5,
    ),
    # A look in under 3 minutes on 2 cores: every implementation and workload at n = 8, and at 32
    # all but one (leave_out) (tests/project/test_benchmarks.py). Its time is mostly start-ups (one interpreter per
    # env in mode="default" and in SubprocVecEnv), so the timed blocks are short and repeated
    # twice; the full suite measures n = 64 and up with longer blocks.
    "quick": dict(
        sizes=[8, 32],
        steps={8: 200, 32: 80},
        warmup=5,
        reps=2,
        code_sizes=[8],
        code_steps=1,
        code_reps=1,
        floor_steps=500,
        straggler_n=8,
        hard_reset_n=8,
        hard_reset_reps=4,
        keep_alive_max_n=64,
        straggler_bound_s=2.0,
        straggler_wedges=2,
        step_timeout_s=0.5,
        # Its 32 fresh interpreters per workload alone cost the suite ~25 s here: boltzlabs[process]
        # measures the same mode at n = 32, and this one runs at n = 8 and in the full suite.
        leave_out={
            "boltzlabs[namespaces]": (
                [32],
                "left out of the quick suite at n=32 (mode=default as boltzlabs[process], which runs; "
                "measured at n=8 and in --suite full)",
            )
        },
    ),
    "full": dict(
        sizes=[8, 64, 256],
        steps={8: 1000, 64: 200, 256: 60, 1024: 15},
        warmup=10,
        reps=3,
        reps_large=1,
        code_sizes=[8, 64],
        code_steps=2,
        code_reps=2,
        floor_steps=2000,
        straggler_n=64,
        hard_reset_n=64,
        hard_reset_reps=20,
        keep_alive_max_n=64,
        straggler_bound_s=3.0,
        step_timeout_s=0.5,
    ),
}

WORKLOADS = {
    "cartpole": dict(desc="CartPole-v1 (cheap step, IPC-bound)", factory=bench_envs.make_cartpole),
    "large_obs": dict(desc="84x84x4 uint8 observation (copy-bound)", factory=bench_envs.make_large_obs),
    "counter": dict(
        desc="JSON counter (ours: RLPool over envs/counter; others: gymnasium Box(1) counter)",
        factory=bench_envs.make_counter,
        env_dir=COUNTER_DIR,
    ),
}

GOOD_SOLUTION, BAD_SOLUTION = CODE_ENV_GOOD, CODE_ENV_WRONG

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- memory
def pss_of_pids(pids) -> list[int]:
    """PSS (bytes) of each pid's whole process tree."""
    out = []
    for pid in pids:
        total = 0
        try:
            p = psutil.Process(pid)
            procs = [p] + p.children(recursive=True)
        except psutil.Error:
            out.append(0)
            continue
        for q in procs:
            try:
                total += q.memory_full_info().pss
            except psutil.Error:
                pass
        out.append(total)
    return out


# --------------------------------------------------------------------------- adapters
class Skip(Exception):
    """The implementation cannot run here; the message is the reason."""


class Impl:
    name = "?"
    ours = False
    in_process = False
    #: Seconds to wait after a timed block so that no other implementation is timed against this
    #: one's still-spinning workers (PufferLib's spin for 0.5 s after a step).
    settle_s = 0.0

    def __init__(self, workload: str, n: int, seed: int):
        self.workload, self.n, self.seed = workload, n, seed
        self.worker_ms: list[float] = []
        self.roundtrip_ms: list[float] = []

    def start(self) -> None:  # create + first reset
        raise NotImplementedError

    def step(self, actions: np.ndarray) -> None:
        raise NotImplementedError

    def pss(self) -> list[int] | None:
        return None

    def close(self) -> None:
        pass


class GymVec(Impl):
    def _make(self, fns):
        raise NotImplementedError

    def start(self):
        fns = [WORKLOADS[self.workload]["factory"]] * self.n
        self.env = self._make(fns)
        self.env.reset(seed=self.seed)

    def step(self, actions):
        self.env.step(actions)

    def close(self):
        self.env.close()


class GymSync(GymVec):
    name, in_process = "gym.SyncVectorEnv", True

    def _make(self, fns):
        return gym.vector.SyncVectorEnv(fns)


class GymAsync(GymVec):
    name = "gym.AsyncVectorEnv(shm)"

    def _make(self, fns):
        return gym.vector.AsyncVectorEnv(fns, shared_memory=True)

    def pss(self):
        return pss_of_pids([p.pid for p in self.env.processes])

    def close(self):
        self.env.close(terminate=True)


class SB3Vec(Impl):
    def start(self):
        fns = [WORKLOADS[self.workload]["factory"]] * self.n
        self.env = self._make(fns)
        self.env.seed(self.seed)
        self.env.reset()

    def step(self, actions):
        self.env.step(actions)

    def close(self):
        self.env.close()


class SB3Subproc(SB3Vec):
    name = "sb3.SubprocVecEnv"

    def _make(self, fns):
        from stable_baselines3.common.vec_env import SubprocVecEnv

        return SubprocVecEnv(fns)

    def pss(self):
        return pss_of_pids([p.pid for p in self.env.processes])


class SB3Dummy(SB3Vec):
    name, in_process = "sb3.DummyVecEnv", True

    def _make(self, fns):
        from stable_baselines3.common.vec_env import DummyVecEnv

        return DummyVecEnv(fns)


class EnvPoolImpl(Impl):
    name = "envpool"

    def start(self):
        try:
            import envpool  # noqa: F401
        except Exception as exc:
            raise Skip(
                f"envpool not importable ({type(exc).__name__}: {exc}); pip install envpool to include it"
            ) from None
        if self.workload != "cartpole":
            raise Skip("envpool runs only its own C++ envs; no Python-env workload")
        self.env = envpool.make_gymnasium("CartPole-v1", num_envs=self.n, seed=self.seed)
        self.env.reset()

    def step(self, actions):
        self.env.step(actions)

    def close(self):
        self.env.close()


class PufferImpl(Impl):
    """PufferLib's Multiprocessing backend as its docs advise: one worker per physical core."""

    name = "pufferlib"
    settle_s = paired.SETTLE_S["pufferlib"]

    def start(self):
        try:
            self.env = paired.make_pufferlib(WORKLOADS[self.workload]["factory"], self.n).env
        except paired.Skip as exc:
            raise Skip(str(exc)) from None
        self.env.reset(seed=self.seed)

    def step(self, actions):
        self.env.step(actions)

    def close(self):
        self.env.close()


class Ours(Impl):
    ours = True
    isolation = "?"
    mode = "default"
    envs_per_sandbox = 1

    def start(self):
        from boltzlabs_gym import BoltzLabsVecEnv, RLPool

        wl = WORKLOADS[self.workload]
        kw = dict(isolation=self.isolation, mode=self.mode)
        if self.envs_per_sandbox > 1:  # only then: K = 1 runs on versions without the keyword
            if wl.get("env_dir"):
                raise Skip(f"{wl['env_dir']} serves reset/step functions; envs_per_sandbox > 1 needs serve(factory=)")
            kw["envs_per_sandbox"] = self.envs_per_sandbox
        try:
            self._create(wl, kw, BoltzLabsVecEnv, RLPool)
        except NotImplementedError as exc:  # mode="boltz" in versions without it
            raise Skip(f"mode={self.mode!r} not implemented in this boltzlabs_gym: {exc}") from None
        except TypeError as exc:
            if "envs_per_sandbox" in str(exc):  # a version without envs_per_sandbox
                raise Skip(f"this boltzlabs_gym ({paired.library_version()}) has no envs_per_sandbox") from None
            raise

    def _create(self, wl, kw, BoltzLabsVecEnv, RLPool):
        if wl.get("env_dir"):
            self.pool = RLPool(wl["env_dir"], self.n, **kw)
            self.vec = None
            self.pool.reset(seed=self.seed)
        else:
            self.vec = BoltzLabsVecEnv([wl["factory"]] * self.n, **kw)
            self.pool = self.vec.pool
            self.vec.reset(seed=self.seed)

    def step(self, actions):
        if self.vec is not None:
            self.vec.step(actions)
        else:
            _, _, dones, _ = self.pool.step(actions.tolist())
            if dones.any():
                self.pool.reset(where=dones)
        t = self.pool.timing
        self.worker_ms.append(t.worker_ms)
        self.roundtrip_ms.append(t.roundtrip_ms)

    def pss(self):
        return self.pool.memory()

    def close(self):
        (self.vec or self.pool).close()


def ours_name(isolation: str, mode: str = "default", k: int = 1) -> str:
    """``boltzlabs[namespaces]``, ``boltzlabs[namespaces,boltz]``, ``boltzlabs[namespaces,boltz,K=32]``."""
    parts = [isolation] + ([mode] if mode != "default" else []) + ([f"K={k}"] if k != 1 else [])
    return f"boltzlabs[{','.join(parts)}]"


def _ours(isolation: str, mode: str = "default", k: int = 1):
    return type(
        f"Ours_{isolation}_{mode}_k{k}",
        (Ours,),
        {"name": ours_name(isolation, mode, k), "isolation": isolation, "mode": mode, "envs_per_sandbox": k},
    )


#: Short names (``--impls``), as paired.py spells them; ours take a ``-kK`` suffix (``boltz-k32``).
BASELINE_IMPLS = {
    "sync": GymSync,
    "async": GymAsync,
    "subproc": SB3Subproc,
    "dummy": SB3Dummy,
    "envpool": EnvPoolImpl,
    "pufferlib": PufferImpl,
}
OURS_SETTINGS = {
    "default": ("namespaces", "default"),
    "process": ("process", "default"),
    "boltz": ("namespaces", "boltz"),
}
DEFAULT_IMPLS = "sync,async,subproc,dummy,envpool,pufferlib,default,process,boltz"


def impl_classes(names: list[str]) -> list[type[Impl]]:
    """The Impl classes for short names (``sync``, ``boltz-k32``, ...), in the order given."""
    out: list[type[Impl]] = []
    for name in names:
        kind, k = paired.split_k(name)
        if name in BASELINE_IMPLS:
            out.append(BASELINE_IMPLS[name])
        elif kind in OURS_SETTINGS:
            out.append(_ours(*OURS_SETTINGS[kind], k=k))
        else:
            raise SystemExit(
                f"unknown implementation {name!r}: {', '.join(BASELINE_IMPLS)}, or one of "
                f"{', '.join(OURS_SETTINGS)} optionally with -kK"
            )
    return out


# --------------------------------------------------------------------------- fan-out floor
ECHO_CHILD = "import os\nwhile True:\n    b = os.read(0, 65536)\n    if not b: break\n    os.write(1, b)\n"


class EchoFloor(Impl):
    """n bare Python echo processes; one fan-out = os.write a line to each, poll until all answered."""

    name = "fan-out floor"

    def start(self):
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-S", "-c", ECHO_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
            )
            for _ in range(self.n)
        ]
        self.wfds = [p.stdin.fileno() for p in self.procs]
        self.rfds = {p.stdout.fileno(): i for i, p in enumerate(self.procs)}
        self.poller = select.poll()
        for fd in self.rfds:
            self.poller.register(fd, select.POLLIN)
        self.step(None)

    def step(self, actions):
        for fd in self.wfds:
            os.write(fd, b"1\n")
        left = len(self.wfds)
        while left:
            for fd, _ev in self.poller.poll():
                data = os.read(fd, 65536)
                if not data:
                    raise RuntimeError("echo child died")
                left -= data.count(b"\n")

    def pss(self):
        return pss_of_pids([p.pid for p in self.procs])

    def close(self):
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()


# --------------------------------------------------------------------------- code-grading workload
def grade_on_trainer(source: str) -> float:
    """What envs/code_env does, unsandboxed, on the trainer."""
    with tempfile.TemporaryDirectory(prefix="bench-grade-") as d:
        with open(os.path.join(d, "solution.py"), "w") as f:
            f.write(source)
        proc = subprocess.run(
            [sys.executable, "-m", "unittest", "discover", "-s", os.path.join(CODE_DIR, "tests")],
            cwd=d,
            capture_output=True,
            text=True,
            timeout=10,
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": d, "HOME": d, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        return 1.0 if proc.returncode == 0 else 0.0


def _sources(actions: np.ndarray) -> list[str]:
    return [GOOD_SOLUTION if a else BAD_SOLUTION for a in actions.tolist()]


class CodeSequential(Impl):
    name, in_process = "trainer sequential (unsandboxed)", True

    def start(self):
        pass

    def step(self, actions):
        [grade_on_trainer(s) for s in _sources(actions)]


class CodeThreads(Impl):
    name, in_process = "trainer ThreadPoolExecutor (unsandboxed)", True

    def start(self):
        self.ex = ThreadPoolExecutor(max_workers=self.n)

    def step(self, actions):
        list(self.ex.map(grade_on_trainer, _sources(actions)))

    def close(self):
        self.ex.shutdown()


class CodeOurs(Ours):
    def start(self):
        from boltzlabs_gym import RLPool

        self.vec = None
        self.pool = RLPool(CODE_DIR, self.n, isolation=self.isolation, mode=self.mode)
        self.pool.reset(seed=self.seed)

    def step(self, actions):
        _, _, dones, _ = self.pool.step(_sources(actions))
        t = self.pool.timing
        self.worker_ms.append(t.worker_ms)
        self.roundtrip_ms.append(t.roundtrip_ms)
        if dones.any():  # one step per episode
            self.pool.reset(where=dones)


def _code_ours(isolation: str):
    return type(f"CodeOurs_{isolation}", (CodeOurs,), {"name": f"boltzlabs[{isolation}]", "isolation": isolation})


CODE_IMPLS = [CodeSequential, CodeThreads, _code_ours("namespaces"), _code_ours("process")]


# --------------------------------------------------------------------------- measurement core
def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else None


def _timed_block(impl: Impl, actions: np.ndarray, warmup: int) -> list[float]:
    for a in actions[:warmup]:
        impl.step(a)
    impl.worker_ms.clear()
    impl.roundtrip_ms.clear()
    lat = []
    for a in actions[warmup:]:
        t = time.perf_counter()
        impl.step(a)
        lat.append(time.perf_counter() - t)
    time.sleep(impl.settle_s)
    return lat


class Record:
    def __init__(self, workload, impl_cls, n, steps, reps):
        self.d = dict(
            workload=workload,
            impl=impl_cls.name,
            ours=impl_cls.ours,
            envs_per_sandbox=getattr(impl_cls, "envs_per_sandbox", None),
            n=n,
            status="ok",
            steps_per_rep=steps,
            reps=reps,
            startup_s=[],
            rep_steps_per_s=[],
            latencies_s=[],
            worker_ms=[],
            roundtrip_ms=[],
            pss_per_env_bytes=None,
            envs_per_gib=None,
            memory_note="in-process (no worker processes)" if impl_cls.in_process else None,
        )

    def add_block(self, impl: Impl, lat: list[float]):
        self.d["rep_steps_per_s"].append(impl.n * len(lat) / sum(lat))
        self.d["latencies_s"].extend(lat)
        self.d["worker_ms"].extend(impl.worker_ms)
        self.d["roundtrip_ms"].extend(impl.roundtrip_ms)

    def set_memory(self, pss):
        if pss:
            total = sum(pss)
            self.d["pss_per_env_bytes"] = total / len(pss)
            self.d["envs_per_gib"] = len(pss) / (total / 2**30) if total else None

    def finish(self) -> dict:
        d = self.d
        if d["status"] == "ok" and d["rep_steps_per_s"]:
            d["steps_per_s"] = float(np.median(d["rep_steps_per_s"]))
            d["latency_ms_median"] = _pct(d["latencies_s"], 50) * 1e3
            d["latency_ms_p99"] = _pct(d["latencies_s"], 99) * 1e3
            d["startup_s_median"] = float(np.median(d["startup_s"]))
            d["worker_ms_median"] = _pct(d["worker_ms"], 50)
            d["roundtrip_ms_median"] = _pct(d["roundtrip_ms"], 50)
        d["latencies_s"] = [round(x, 7) for x in d["latencies_s"]]
        return d


def _start(impl: Impl, rec: Record) -> bool:
    t = time.perf_counter()
    try:
        impl.start()
    except Skip as exc:
        rec.d.update(status="skipped", reason=str(exc))
        log(f"  skip {rec.d['impl']}: {exc}")
        _safe_close(impl)
        return False
    except Exception as exc:
        rec.d.update(status="error", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        log(f"  ERROR starting {rec.d['impl']}: {type(exc).__name__}: {exc}")
        _safe_close(impl)
        return False
    rec.d["startup_s"].append(time.perf_counter() - t)
    return True


def _safe_close(impl):
    try:
        impl.close()
    except Exception:
        pass


def run_matrix(workload: str, impl_classes, n: int, actions: np.ndarray, cfg: dict, seed: int) -> list[dict]:
    """All implementations of one (workload, n), interleaved per repetition."""
    reps, warmup = cfg["reps"], cfg["warmup"]
    steps = len(actions) - warmup
    recs = {cls: Record(workload, cls, n, steps, reps) for cls in impl_classes}
    keep_alive = n <= cfg["keep_alive_max_n"]
    for cls in impl_classes:
        sizes, why = cfg.get("leave_out", {}).get(cls.name, ((), ""))
        if n in sizes:
            recs[cls].d.update(status="skipped", reason=why)
            log(f"  skip {cls.name} n={n}: {why}")
    impl_classes = [cls for cls in impl_classes if recs[cls].d["status"] == "ok"]
    live: dict = {}
    if keep_alive:
        for cls in impl_classes:
            impl = cls(workload, n, seed)
            log(f"  start {cls.name} n={n}")
            if _start(impl, recs[cls]):
                live[cls] = impl
                try:
                    recs[cls].set_memory(impl.pss())
                except Exception as exc:
                    recs[cls].d["memory_note"] = f"memory failed: {exc}"
    runnable = list(live) if keep_alive else list(impl_classes)
    if not keep_alive:
        reps = cfg.get("reps_large", reps)
        for rec in recs.values():
            rec.d["reps"] = reps
    for rep in range(reps):
        order = runnable if rep % 2 == 0 else runnable[::-1]
        for cls in order:
            rec = recs[cls]
            if rec.d["status"] != "ok":
                continue
            if keep_alive:
                impl = live[cls]
            else:
                impl = cls(workload, n, seed)
                log(f"  start {cls.name} n={n} (rep {rep + 1})")
                if not _start(impl, rec):
                    continue
                if rec.d["pss_per_env_bytes"] is None and not cls.in_process:
                    try:
                        rec.set_memory(impl.pss())
                    except Exception as exc:
                        rec.d["memory_note"] = f"memory failed: {exc}"
            try:
                lat = _timed_block(impl, actions, warmup)
                rec.add_block(impl, lat)
                log(
                    f"  {workload} n={n} rep {rep + 1}/{reps} {cls.name:40s} "
                    f"{rec.d['rep_steps_per_s'][-1]:12,.0f} steps/s"
                )
            except Exception as exc:
                rec.d.update(status="error", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
                log(f"  ERROR {cls.name}: {exc}")
            if not keep_alive:
                _safe_close(impl)
    for impl in live.values():
        _safe_close(impl)
    return [r.finish() for r in recs.values()]


# --------------------------------------------------------------------------- special measurements
def bench_hard_reset(n: int, reps: int, seed: int) -> list[dict]:
    out = []
    for iso in ("namespaces", "process"):
        for workload in ("counter", "cartpole"):
            cls = _ours(iso)
            impl = cls(workload, n, seed)
            rec = dict(workload=workload, impl=cls.name, n=n, reps=reps)
            try:
                impl.start()
                lat = []
                for k in range(reps):
                    where = np.zeros(n, dtype=bool)
                    where[k % n] = True
                    t = time.perf_counter()
                    impl.pool.reset(where=where, hard=True, seed=seed + k)
                    lat.append(time.perf_counter() - t)
                rec.update(
                    status="ok",
                    hard_reset_ms_median=_pct(lat, 50) * 1e3,
                    hard_reset_ms_p99=_pct(lat, 99) * 1e3,
                    hard_reset_s=lat,
                )
                log(f"  hard reset {workload} {cls.name} n={n}: median {rec['hard_reset_ms_median']:.1f} ms")
            except Exception as exc:
                rec.update(status="error", reason=f"{type(exc).__name__}: {exc}")
                log(f"  ERROR hard reset {cls.name}: {exc}")
            finally:
                _safe_close(impl)
            out.append(rec)
    return out


def bench_straggler(n: int, cfg: dict, seed: int) -> list[dict]:
    """One env wedged forever in one step; everyone else steps normally."""
    from boltzlabs_gym import RLPool

    deadline, bound = cfg["step_timeout_s"], cfg["straggler_bound_s"]
    out = []
    wedge = np.zeros(n, dtype=np.int64)
    wedge[n // 2] = 2
    normal = np.zeros(n, dtype=np.int64)
    for iso in ("namespaces", "process"):
        rec = dict(impl=f"boltzlabs[{iso}]", n=n, step_timeout_s=deadline)
        pool = None
        try:
            pool = RLPool(HANG_DIR, n, isolation=iso, step_timeout=deadline)
            pool.reset(seed=seed)
            normal_lat, wedged_lat, recover_lat = [], [], []
            for _ in range(20):
                t = time.perf_counter()
                pool.step(normal.tolist())
                normal_lat.append(time.perf_counter() - t)
            for _ in range(cfg.get("straggler_wedges", 3)):
                t = time.perf_counter()
                _, _, dones, infos = pool.step(wedge.tolist())
                wedged_lat.append(time.perf_counter() - t)
                t = time.perf_counter()
                pool.reset(where=dones)  # respawn the straggler
                pool.step(normal.tolist())
                recover_lat.append(time.perf_counter() - t)
            rec.update(
                status="ok",
                outcome="recovers",
                normal_step_ms=_pct(normal_lat, 50) * 1e3,
                straggler_step_ms=_pct(wedged_lat, 50) * 1e3,
                recovery_ms=_pct(recover_lat, 50) * 1e3,
                straggler_flagged=bool(infos[n // 2].get("boltzlabs_straggler")),
            )
            log(
                f"  straggler {rec['impl']} n={n}: step {rec['straggler_step_ms']:.0f} ms "
                f"(deadline {deadline * 1e3:.0f} ms)"
            )
        except Exception as exc:
            rec.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            log(f"  ERROR straggler {rec['impl']}: {exc}")
        finally:
            if pool is not None:
                pool.close()
        out.append(rec)

    # Gymnasium AsyncVectorEnv: step_wait(timeout=...) raises, but the env stays wedged.
    rec = dict(impl="gym.AsyncVectorEnv(shm)", n=n, bound_s=bound)
    env = gym.vector.AsyncVectorEnv([bench_envs.make_hang] * n, shared_memory=True)
    try:
        env.reset(seed=seed)
        env.step_async(wedge)
        t = time.perf_counter()
        try:
            env.step_wait(timeout=bound)
            rec.update(status="ok", outcome="returned (unexpected)")
        except mp.TimeoutError:
            rec.update(
                status="ok",
                outcome="hangs",
                detail=f"step_wait(timeout={bound}) raised TimeoutError after {time.perf_counter() - t:.2f} s; "
                "the wedged worker cannot be recovered, only terminated (close(terminate=True))",
            )
    finally:
        t = time.perf_counter()
        env.close(terminate=True)
        rec["close_terminate_s"] = time.perf_counter() - t
    log(f"  straggler {rec['impl']} n={n}: {rec.get('outcome')}")
    out.append(rec)

    # SB3 SubprocVecEnv has no deadline API: poll its pipes for `bound` seconds, then kill.
    from stable_baselines3.common.vec_env import SubprocVecEnv

    rec = dict(impl="sb3.SubprocVecEnv", n=n, bound_s=bound)
    env = SubprocVecEnv([bench_envs.make_hang] * n)
    try:
        env.reset()
        env.step_async(wedge)
        deadline_t = time.perf_counter() + bound
        answered = set()
        while len(answered) < n and time.perf_counter() < deadline_t:
            for i, r in enumerate(env.remotes):
                if i not in answered and r.poll(0.01):
                    answered.add(i)
        rec.update(
            status="ok",
            outcome="hangs" if len(answered) < n else "returned (unexpected)",
            detail=f"{n - len(answered)} of {n} workers silent after {bound} s; step_wait() has no timeout "
            "and close() would block on the wedged pipe: processes terminated by hand",
        )
    finally:
        for p in env.processes:
            p.terminate()
        for p in env.processes:
            p.join(5)
        env.closed = True
    log(f"  straggler {rec['impl']} n={n}: {rec['outcome']}")
    out.append(rec)
    for name in ("gym.SyncVectorEnv", "sb3.DummyVecEnv"):
        out.append(
            dict(
                impl=name,
                n=n,
                status="ok",
                outcome="hangs",
                detail="in-process: a wedged env step blocks the trainer itself (not attempted)",
            )
        )
    return out


# --------------------------------------------------------------------------- machine info
def machine_info() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {}
    for pkg in (
        "boltzlabs_gym",
        "gymnasium",
        "stable-baselines3",
        "numpy",
        "torch",
        "pyzmq",
        "cloudpickle",
        "psutil",
        "matplotlib",
        "envpool",
        "pufferlib",
        "pufferlib-core",
    ):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    return dict(
        cpu_count=os.cpu_count(),
        cpu_affinity=len(os.sched_getaffinity(0)),
        cpu_model=model,
        mem_total_bytes=psutil.virtual_memory().total,
        python=sys.version,
        platform=platform.platform(),
        versions=versions,
        git_commit=commit,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="quick")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--sizes", help="comma-separated env counts, overriding the suite's")
    ap.add_argument(
        "--workloads",
        default="cartpole,large_obs,counter,code",
        help="comma-separated subset of cartpole,large_obs,counter,code",
    )
    ap.add_argument(
        "--impls",
        default=DEFAULT_IMPLS,
        help=f"comma-separated short names (default {DEFAULT_IMPLS}); "
        "ours (default, process, boltz) take -kK for envs_per_sandbox=K: boltz-k32",
    )
    ap.add_argument("--envs-per-sandbox", help="comma-separated K values to run each of ours at (e.g. 1,8,32)")
    ap.add_argument("--reps", type=int, help="timed blocks per implementation, overriding the suite's (all sizes)")
    ap.add_argument("--throughput-only", action="store_true", help="skip the hard-reset and straggler measurements")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)

    cfg = dict(SUITES[args.suite])
    if args.reps:
        cfg.update(reps=args.reps, reps_large=args.reps)
    impls = impl_classes(paired.expand_k(args.impls.split(","), paired.parse_ks(args.envs_per_sandbox)))
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else cfg["sizes"]
    workloads = [w for w in args.workloads.split(",") if w]
    os.makedirs(args.out, exist_ok=True)

    def steps_for(n):
        keys = sorted(cfg["steps"])
        k = min(keys, key=lambda k: abs(np.log(k) - np.log(n)))
        return max(5, int(cfg["steps"][k] * min(1.0, k / n))) if n > k else cfg["steps"][k]

    result = dict(
        suite=args.suite,
        sizes=sizes,
        config=cfg,
        seed=args.seed,
        machine=machine_info(),
        loadavg_start=list(os.getloadavg()),
        workloads={k: v["desc"] for k, v in WORKLOADS.items()},
        runs=[],
        floor=[],
        hard_reset=[],
        straggler=[],
        skipped=[],
    )
    result["workloads"]["code"] = (
        "code grading (ours: RLPool over envs/code_env; baseline: unsandboxed subprocess on the trainer)"
    )
    log(f"suite={args.suite} sizes={sizes} loadavg={result['loadavg_start']}")

    for n in sizes:
        rng = np.random.default_rng(args.seed + n)
        steps = steps_for(n)
        log(f"fan-out floor n={n}")
        floor_actions = np.zeros((cfg["warmup"] + max(steps, cfg["floor_steps"] * 8 // max(n, 8)), n), dtype=np.int64)
        result["floor"].extend(run_matrix("floor", [EchoFloor], n, floor_actions, cfg, args.seed))
        for wl in workloads:
            if wl == "code":
                continue
            log(f"{wl} n={n} steps={steps} reps={cfg['reps']}")
            actions = rng.integers(0, 2, size=(cfg["warmup"] + steps, n), dtype=np.int64)
            result["runs"].extend(run_matrix(wl, impls, n, actions, cfg, args.seed))
    if "code" in workloads:
        ccfg = dict(cfg, reps=cfg["code_reps"], warmup=1)
        for n in cfg["code_sizes"]:
            log(f"code n={n} steps={cfg['code_steps']}")
            rng = np.random.default_rng(args.seed + 7 * n)
            actions = rng.integers(0, 2, size=(1 + cfg["code_steps"], n), dtype=np.int64)
            result["runs"].extend(run_matrix("code", CODE_IMPLS, n, actions, ccfg, args.seed))

    if not args.throughput_only:
        log(f"hard reset n={cfg['hard_reset_n']}")
        result["hard_reset"] = bench_hard_reset(cfg["hard_reset_n"], cfg["hard_reset_reps"], args.seed)
        log(f"straggler n={cfg['straggler_n']}")
        result["straggler"] = bench_straggler(cfg["straggler_n"], cfg, args.seed)

    seen = set()
    for r in result["runs"]:
        if r["status"] != "ok" and (r["impl"], r.get("reason")) not in seen:
            seen.add((r["impl"], r.get("reason")))
            result["skipped"].append(
                dict(impl=r["impl"], workload=r["workload"], status=r["status"], reason=r.get("reason"))
            )
    result["loadavg_end"] = list(os.getloadavg())
    result["elapsed_s"] = time.perf_counter() - T0

    import report

    with open(os.path.join(args.out, "latest.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    md = report.markdown(result)
    with open(os.path.join(args.out, "latest.md"), "w") as f:
        f.write(md)
    if not args.no_plots:
        report.plots(result, args.out)
    log(f"done in {result['elapsed_s']:.0f} s; loadavg start {result['loadavg_start']} end {result['loadavg_end']}")
    log(f"wrote {args.out}/latest.json, latest.md, *.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
