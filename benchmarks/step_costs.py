#!/usr/bin/env python
"""Where each microsecond of a BoltzLabsVecEnv step goes: trainer, envs, wake-ups, bytes.

    python benchmarks/step_costs.py                                   # the default configurations
    python benchmarks/step_costs.py --configs cartpole:64:1,large_obs:64:8 --seconds 3

Each configuration is ``env:n:K`` (``K`` = ``envs_per_sandbox``; ``env`` one of
``cartpole``, ``large_obs``, ``dict_obs`` from ``bench_envs.py``, or the real envs of
``real_env_factories.py``, ``halfcheetah`` and ``pong`` (install ``boltzlabs-gym[real-envs]``),
with ``+bytes`` for ``shared_obs=False``: ``dict_obs+bytes:64:1``), built through the public API
as ``benchmarks/paired.py`` builds ``default`` (mode="default", the direct lane). After a reset and
a warm-up, two blocks of steps with the same all-zeros actions (Discrete, or a Box batch):

1. **Unprofiled**, for about ``--seconds``: wall time per step; the trainer's CPU (its main
   thread, ``time.thread_time``, and the whole process with its ZeroMQ threads,
   ``getrusage``); the CPU of the worker and of the env processes (every descendant of this
   process, ``/proc/<pid>/task/*/schedstat``, nanoseconds); context switches of the
   trainer's main thread and of the envs (``/proc/<pid>/status``: *voluntary* = the process
   slept and was woken, i.e. a wake-up; *involuntary* = preempted); and the bytes passed
   through ``read``/``write`` system calls (``/proc/<pid>/io`` ``rchar``/``wchar``).
2. **Profiled**: ``cProfile`` with a CPU-time clock (``time.thread_time``) around the step
   calls, each function's own time put in one group: *encode* (actions to request lines),
   *write* (the pipe writes), *wait* (epoll and the wait loop; CPU only, not the time
   asleep), *read/parse* (pipe reads, reply validation and parsing), *copy obs* (the
   replies' observations into the batch), *return* (the batch handed back: ``copy=True``'s
   copy, the reward and flag copies), *other* (dispatch, state checks, the pool's books).
   A function no rule names (``len``, ``json.loads``, a helper) goes to the groups of its
   callers, in proportion to the time each call edge took. The profiler
   inflates many small calls more than a few large ones, so the table gives each group's
   *share* of the profiled CPU, applied to the unprofiled main-thread CPU per step.

For scale, each configuration's env is also stepped in this process, alone (``env.step``'s
CPU per step, no pool): the rest of an env process's CPU per env-step is what the process,
its pipe and its wake-ups cost.

The observation bytes the trainer copies in memory are counted from the code's path (one
copy of every env's observation into the batch, one more of the batch when ``copy=True``),
not measured. Prints two Markdown tables (totals; the trainer's groups) with the date, the
library's commit and ``uptime``.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import os
import pstats
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_envs  # noqa: E402
import cloudpickle  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import real_env_factories  # noqa: E402
from wakeups import switches  # noqa: E402

from boltzlabs_gym import BoltzLabsVecEnv  # noqa: E402


def flatten_spaces(space: gym.Space) -> list:
    """The array spaces of ``space`` (itself, or the leaves of a Dict/Tuple with a shape)."""
    if isinstance(space, gym.spaces.Dict):
        return [leaf for sub in space.spaces.values() for leaf in flatten_spaces(sub)]
    if isinstance(space, gym.spaces.Tuple):
        return [leaf for sub in space.spaces for leaf in flatten_spaces(sub)]
    return [space] if space.shape else []


cloudpickle.register_pickle_by_value(bench_envs)  # sandboxes cannot import this directory
cloudpickle.register_pickle_by_value(real_env_factories)

FACTORIES = {
    "cartpole": bench_envs.make_cartpole,
    "large_obs": bench_envs.make_large_obs,
    "dict_obs": bench_envs.make_dict_obs,
    "halfcheetah": real_env_factories.make_half_cheetah,
    "pong": real_env_factories.make_pong,
}
DEFAULT_CONFIGS = "cartpole:8:1,cartpole:8:8,cartpole:64:1,cartpole:64:8,large_obs:64:1,large_obs:64:8"
GROUPS = ("encode", "write", "wait", "read/parse", "copy obs", "return", "other")

#: (path suffix or "~" for C functions, function name) -> group; names not listed inherit their callers' group.
RULES: dict[tuple[str, str], str] = {}


def _rule(group: str, where: str, *names: str) -> None:
    for name in names:
        RULES[(where, name)] = group


_rule(
    "encode",
    "boltzlabs_gym/vector/step_batch.py",
    "send_step",
    "discrete_actions",
    "step_item",
    "encode_action",
    "encode_env_action",
    "split_actions",
)
_rule("encode", "boltzlabs_gym/vector/step_batch.py", "action_rows")
_rule("encode", "boltzlabs_gym/client/routes.py", "send")
_rule(
    "encode",
    "boltzlabs_gym/client/sandbox_route.py",
    "send",
    "send_steps",
    "send_action_rows",
    "step_items",
    "_answer_restarted",
)
_rule(
    "encode",
    "boltzlabs_gym/client/sandbox_replies.py",
    "pack",
    "pack_steps",
    "pack_action_rows",
    "_slots",
    "_sandbox_request",
    "_shorthand",
)
_rule("encode", "boltzlabs_gym/client/batch_calls.py", "send", "send_steps", "send_action_rows")
_rule("encode", "boltzlabs_gym/wire/protocol.py", "env_request", "env_request_line", "array_step_line")
_rule("encode", "~", "<method 'tolist' of 'numpy.ndarray' objects>")
_rule("write", "boltzlabs_gym/client/direct_lane.py", "send", "_write")
_rule("write", "boltzlabs_gym/wire/envpipe.py", "write", "write_parts", "flush", "_write_some")
_rule("write", "boltzlabs_gym/wire/call_rules.py", "call_timeout")
_rule("write", "~", "<built-in method posix.write>", "<built-in method posix.writev>")
_rule("wait", "boltzlabs_gym/client/direct_lane.py", "wait", "_gather", "_nap", "_expire", "collect")
_rule("wait", "~", "<method 'poll' of 'select.epoll' objects>", "<built-in method time.sleep>")
_rule(
    "read/parse",
    "boltzlabs_gym/wire/envpipe.py",
    "read_replies",
    "_read_body",
    "_take_whole_reply",
    "_parse",
    "_split",
    "_announced_payloads",
)
_rule("read/parse", "boltzlabs_gym/client/direct_lane.py", "_on_readable")
_rule("read/parse", "boltzlabs_gym/client/routes.py", "wait")
_rule("read/parse", "boltzlabs_gym/client/sandbox_route.py", "wait_sandboxes", "wait")
_rule(
    "read/parse",
    "boltzlabs_gym/client/sandbox_replies.py",
    "read",
    "_read_now",
    "_read_sandbox",
    "_declared_obs",
    "_nd",
    "_position_key",
    "__init__",
    "expand",
    "failures",
)
_rule("read/parse", "boltzlabs_gym/vector/step_batch.py", "read_step", "read_reset", "take_step")
_rule("read/parse", "boltzlabs_gym/vector/fast_paths.py", "read")
# Infos: read from the replies and batched as Gymnasium's infos (typed columns or the general path).
_rule(
    "read/parse",
    "boltzlabs_gym/vector/fast_paths.py",
    "add_info_rows",
    "add_pending_infos",
    "take_with_info",
    "info_layout",
)
_rule("read/parse", "boltzlabs_gym/vector/step_batch.py", "decode_info")
_rule("read/parse", "gymnasium/vector/vector_env.py", "_add_info")
_rule("read/parse", "boltzlabs_gym/wire/codec.py", "decode_info", "_decode_info", "parse_info_step_line")
_rule("read/parse", "boltzlabs_gym/wire/codec.py", "parse_step_line")
_rule("read/parse", "boltzlabs_gym/client/results.py", "parse_result", "read_step", "read_reset", "__init__")
_rule("read/parse", "~", "<built-in method posix.read>", "<built-in method posix.readv>")
_rule("copy obs", "boltzlabs_gym/vector/fast_paths.py", "take", "take_step")
_rule("copy obs", "boltzlabs_gym/vector/step_batch.py", "set_obs")
_rule("copy obs", "~", "<built-in method numpy.frombuffer>")
_rule("return", "boltzlabs_gym/vector/step_batch.py", "batched_obs", "collect_step")
_rule("return", "~", "<method 'copy' of 'numpy.ndarray' objects>")
_rule("other", "boltzlabs_gym/vector/vec_env.py", "step", "step_async", "step_wait", "_check_open", "_check_idle")
_rule("other", "boltzlabs_gym/vector/step_batch.py", "wait")
_rule("other", "boltzlabs_gym/client/batch_calls.py", "_collect", "_record", "wait_sandboxes", "wait", "_check_idle")
_rule("other", "boltzlabs_gym/client/timing.py", "after_batch")
_rule("other", "boltzlabs_gym/client/stats.py", "batch")
_rule("other", "benchmarks/step_costs.py", "run_steps")


# --------------------------------------------------------------------------- processes
def descendants() -> list[int]:
    """Every process below this one (the worker, the envs, any sandbox helper)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"boltzlabs_gym.worker" in f.read()
    except OSError:
        return False


def cpu_ns(pid: int) -> int:
    """CPU nanoseconds of every thread of ``pid`` (0 once it is gone)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def io_chars(pid: int | str) -> tuple[int, int]:
    """``(rchar, wchar)``: bytes ``pid`` passed through read and write system calls."""
    values = {}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                values[key] = int(value)
    except OSError:
        return 0, 0
    return values.get("rchar", 0), values.get("wchar", 0)


class Snapshot:
    """The counters of the trainer, the worker and the envs at one moment."""

    def __init__(self, workers: list[int], envs: list[int]):
        self.wall = time.perf_counter()
        self.main_cpu = time.thread_time()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.proc_cpu = usage.ru_utime + usage.ru_stime
        self.main_switches = switches(f"{os.getpid()}/task/{os.getpid()}")
        self.trainer_io = io_chars("self")
        self.worker_cpu = sum(cpu_ns(p) for p in workers)
        self.env_cpu = sum(cpu_ns(p) for p in envs)
        sw = [switches(p) for p in envs]
        self.env_switches = (sum(v for v, _ in sw), sum(i for _, i in sw))
        io = [io_chars(p) for p in envs]
        self.env_io = (sum(r for r, _ in io), sum(w for _, w in io))


# --------------------------------------------------------------------------- profile groups
def group_of(func: tuple, stats: dict, memo: dict, depth: int = 0) -> dict[str, float]:
    """The groups (weights summing to 1) that ``func``'s own time belongs to."""
    if func in memo:
        return memo[func]
    path, _line, name = func
    where = "~" if path == "~" else next((s for s, n in RULES if n == name and path.endswith(s)), None)
    if where is not None and (where, name) in RULES:
        memo[func] = {RULES[(where, name)]: 1.0}
        return memo[func]
    callers = stats[func][4] if func in stats else {}
    total = sum(edge[2] for edge in callers.values())
    if depth > 20 or not callers or total <= 0:
        memo[func] = {"other": 1.0}
        return memo[func]
    memo[func] = {"other": 1.0}  # a recursion guard while the callers are resolved
    weights: dict[str, float] = {}
    for caller, edge in callers.items():
        for group, w in group_of(caller, stats, memo, depth + 1).items():
            weights[group] = weights.get(group, 0.0) + w * edge[2] / total
    memo[func] = weights
    return weights


def profile_groups(profile: cProfile.Profile) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """CPU seconds per group in a profile (own time of each function), and per function in each group."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    memo: dict = {}
    out = {g: 0.0 for g in GROUPS}
    by_func: dict[str, dict[str, float]] = {g: {} for g in GROUPS}
    for func, (_cc, _nc, tt, _ct, _callers) in stats.items():
        label = func_label(func)
        for group, w in group_of(func, stats, memo).items():
            out[group] += tt * w
            by_func[group][label] = by_func[group].get(label, 0.0) + tt * w
    return out, by_func


def func_label(func: tuple) -> str:
    """``module.function`` (``envpipe._parse``), or a C function's own name (``posix.read``)."""
    path, _line, name = func
    if path == "~":
        return name.strip("<>").replace("built-in method ", "").replace("method ", "")
    return f"{os.path.splitext(os.path.basename(path))[0]}.{name}"


# --------------------------------------------------------------------------- measurement
def run_steps(env, actions: np.ndarray, steps: int) -> None:
    for _ in range(steps):
        env.step(actions)


def zero_action(space: gym.Space):
    """The all-zeros action of ``space`` (Discrete: 0; a Box: zeros of its dtype and shape)."""
    return 0 if isinstance(space, gym.spaces.Discrete) else np.zeros(space.shape, dtype=space.dtype)


def bare_step_us(factory, steps: int = 2000) -> float:
    """CPU microseconds of one step of the env itself, in this process (no pool, no pipe): what
    an env process would pay per step if nothing else did."""
    env = factory()
    env.reset(seed=0)
    action = zero_action(env.action_space)
    t0 = time.thread_time()
    for _ in range(steps):
        _obs, _reward, terminated, truncated, _info = env.step(action)
        if terminated or truncated:
            env.reset()
    elapsed = time.thread_time() - t0
    env.close()
    return elapsed / steps * 1e6


def measure(env_name: str, n: int, k: int, seconds: float, profiled_steps: int) -> dict:
    factory = FACTORIES[env_name.removesuffix("+bytes")]
    kwargs: dict = {"envs_per_sandbox": k} if k > 1 else {}
    if env_name.endswith("+bytes"):
        kwargs["shared_obs"] = False
    t0 = time.perf_counter()
    env = BoltzLabsVecEnv([factory] * n, **kwargs)
    try:
        print(f"  {env_name} n={n} K={k}: started in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        env.reset(seed=0)
        space = env.single_action_space
        actions = np.zeros((n, *space.shape), dtype=space.dtype) if space.shape else np.zeros(n, dtype=np.int64)
        # Warm up, and time a few steps to size the block.
        t = time.perf_counter()
        run_steps(env, actions, 30)
        per_step = (time.perf_counter() - t) / 30
        steps = max(50, int(seconds / per_step))
        procs = descendants()
        workers = [p for p in procs if is_worker(p)]
        envs = [p for p in procs if p not in workers]
        before = Snapshot(workers, envs)
        run_steps(env, actions, steps)
        after = Snapshot(workers, envs)
        if set(descendants()) != set(procs):
            print("  warning: processes came or went during the timed block", file=sys.stderr)
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        run_steps(env, actions, profiled_steps)
        prof.disable()
        groups, by_func = profile_groups(prof)
        obs_bytes = sum(
            int(np.prod(space.shape)) * space.dtype.itemsize for space in flatten_spaces(env.single_observation_space)
        )
        copy = bool(env.copy)
    finally:
        env.close()
    return {
        "env": env_name,
        "n": n,
        "k": k,
        "steps": steps,
        "envs": len(envs),
        "wall_us": (after.wall - before.wall) / steps * 1e6,
        "main_cpu_us": (after.main_cpu - before.main_cpu) / steps * 1e6,
        "proc_cpu_us": (after.proc_cpu - before.proc_cpu) / steps * 1e6,
        "worker_cpu_us": (after.worker_cpu - before.worker_cpu) / steps / 1e3,
        "env_cpu_us": (after.env_cpu - before.env_cpu) / steps / 1e3,
        "main_vol": (after.main_switches[0] - before.main_switches[0]) / steps,
        "main_invol": (after.main_switches[1] - before.main_switches[1]) / steps,
        "env_vol": (after.env_switches[0] - before.env_switches[0]) / steps,
        "env_invol": (after.env_switches[1] - before.env_switches[1]) / steps,
        "trainer_read": (after.trainer_io[0] - before.trainer_io[0]) / steps,
        "trainer_written": (after.trainer_io[1] - before.trainer_io[1]) / steps,
        "env_read": (after.env_io[0] - before.env_io[0]) / steps,
        "env_written": (after.env_io[1] - before.env_io[1]) / steps,
        "obs_copied": n * obs_bytes * (2 if copy else 1),
        "bare_us": bare_step_us(factory),
        "groups": groups,
        "by_func": by_func,
    }


def fmt_bytes(x: float) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if x >= size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


def print_tables(rows: list[dict]) -> None:
    print(
        "| env | n | K | steps | wall/step (us) | trainer CPU/step: main thread (us) | whole process (us) "
        "| envs' CPU/step (us) | per env-step (us) | the env's own step, in process (us) | worker (us) "
        "| wake-ups/step: trainer vol+invol "
        "| envs vol+invol | pipe bytes/step: envs wrote | trainer read | trainer wrote | obs bytes copied in trainer |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['env']} | {r['n']} | {r['k']} | {r['steps']} | {r['wall_us']:.0f} | {r['main_cpu_us']:.0f} "
            f"| {r['proc_cpu_us']:.0f} | {r['env_cpu_us']:.0f} | {r['env_cpu_us'] / r['n']:.1f} | {r['bare_us']:.1f} "
            f"| {r['worker_cpu_us']:.0f} | {r['main_vol']:.1f}+{r['main_invol']:.1f} "
            f"| {r['env_vol']:.1f}+{r['env_invol']:.1f} | {fmt_bytes(r['env_written'])} "
            f"| {fmt_bytes(r['trainer_read'])} | {fmt_bytes(r['trainer_written'])} | {fmt_bytes(r['obs_copied'])} |"
        )
    print()
    print(
        "Trainer main-thread CPU per step by group, us (share of the profiled CPU x the unprofiled "
        "main-thread CPU per step):\n"
    )
    print("| env | n | K | " + " | ".join(GROUPS) + " | total |")
    print("|---|---:|---:|" + "---:|" * (len(GROUPS) + 1))
    for r in rows:
        profiled = sum(r["groups"].values()) or 1.0
        cells = [r["groups"][g] / profiled * r["main_cpu_us"] for g in GROUPS]
        print(
            f"| {r['env']} | {r['n']} | {r['k']} | "
            + " | ".join(f"{c:.0f} ({c / r['main_cpu_us'] * 100:.0f}%)" for c in cells)
            + f" | {r['main_cpu_us']:.0f} |"
        )


def print_top(rows: list[dict], top: int) -> None:
    """Per configuration and group, the functions with most of the group's profiled CPU."""
    print(f"\nTop {top} functions of each group (share of the group's profiled CPU):\n")
    for r in rows:
        print(f"* {r['env']} n={r['n']} K={r['k']}:")
        for group in GROUPS:
            funcs = r["by_func"][group]
            total = sum(funcs.values()) or 1.0
            best = sorted(funcs.items(), key=lambda kv: -kv[1])[:top]
            print(f"  * {group}: " + ", ".join(f"`{name}` {sec / total * 100:.0f}%" for name, sec in best))


def library_commit() -> str:
    import boltzlabs_gym

    root = os.path.dirname(os.path.dirname(os.path.abspath(boltzlabs_gym.__file__)))
    proc = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{root} at {proc.stdout.strip() or 'unknown commit'}"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated env:n:K")
    parser.add_argument("--seconds", type=float, default=3.0, help="about this long per unprofiled block")
    parser.add_argument("--profiled-steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=3, help="name the top functions of each group (0: none)")
    args = parser.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = uptime()
    rows = []
    for config in args.configs.split(","):
        env_name, n, k = config.split(":")
        if env_name.removesuffix("+bytes") not in FACTORIES:
            raise SystemExit(f"unknown env {env_name!r} in {config!r}: {', '.join(FACTORIES)}")
        rows.append(measure(env_name, int(n), int(k), args.seconds, args.profiled_steps))
    print(f"step costs: {started}, {os.cpu_count()} CPUs; boltzlabs_gym: {library_commit()}")
    print(f"load before: `{load_before}`; after: `{uptime()}`\n")
    print_tables(rows)
    if args.top:
        print_top(rows, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
