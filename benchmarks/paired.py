#!/usr/bin/env python
"""Paired throughput: every implementation alive at once, short blocks in rotating order.

    python benchmarks/paired.py --sizes 8,64,256                 # CartPole-v1, ours vs SyncVectorEnv and AsyncVectorEnv
    python benchmarks/paired.py --env large_obs --sizes 8 --impls async,default,boltz  # frames; dict_obs: in a Dict
    python benchmarks/paired.py --sizes 256 --impls sync,async,subproc,dummy,envpool,pufferlib,default,boltz \\
        --envs-per-sandbox 1,32                                  # ours with 1 and with 32 envs per sandbox

On a shared machine whose speed moves by 2-3x within minutes, one timed block per
implementation (``run.py``) compares samples taken minutes apart. Here every
implementation of one size is started first, then each round times one short block of
each, in an order rotated every round, and the figures are the medians over rounds of
``SyncVectorEnv's block time / this implementation's`` and ``AsyncVectorEnv's block time /
this implementation's``: both sides of every ratio come from the same few seconds of the
machine's life. Prints a Markdown table on stdout, then a line per skipped implementation
with the reason (and ``--json PATH`` gets all of it); progress goes to stderr.

Implementations: the references ``sync`` (gymnasium SyncVectorEnv) and ``async``
(AsyncVectorEnv, shared memory), always measured; ``subproc`` and ``dummy`` (SB3
SubprocVecEnv / DummyVecEnv), ``envpool`` (CartPole only) and ``pufferlib``
(Multiprocessing backend, one worker per core), each skipped with its reason when not
importable; and ours: ``default``, ``boltz``, ``process`` (BoltzLabsVecEnv with
mode="default" / mode="boltz" / isolation="process"). Suffix one of ours with ``-kK`` for
``envs_per_sandbox=K`` (``boltz-k32``), or give ``--envs-per-sandbox 1,8,32`` to run each
of ours listed without a suffix at every K. Append ``@US`` to set ``busy_poll_us``
(``default@0``), ``+aslr`` for ``env_aslr=True`` (``default+aslr``: every env interpreter
with its own randomized layout, as before that became the default), and ``+hop`` for
``direct=False`` (``default+hop``: every step through the worker, as before the direct
lane), and ``+bytes`` for ``shared_obs=False`` (``default+bytes``: observations on the envs'
pipes rather than in shared memory). ``envs_per_sandbox`` is passed only when K > 1, so K = 1 runs against versions of
boltzlabs_gym that predate it (before/after comparisons). A final ``+metrics``
(``default+metrics``, ``default+hop+metrics``) serves the worker's ``/metrics`` and scrapes it
once a second while the pool steps, 15 times the usual Prometheus rate (metrics must cost
nothing measurable on the step path).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_envs  # noqa: E402
import cloudpickle  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

from boltzlabs_gym import BoltzLabsVecEnv  # noqa: E402

cloudpickle.register_pickle_by_value(bench_envs)  # sandboxes cannot import this directory
# SB3's SubprocVecEnv forks its workers from a forkserver: preload what they import (as run.py does).
mp.set_forkserver_preload(["stable_baselines3.common.vec_env", "gymnasium", "numpy", "bench_envs"])

FACTORIES = {
    "cartpole": bench_envs.make_cartpole,
    "large_obs": bench_envs.make_large_obs,
    "dict_obs": bench_envs.make_dict_obs,
}
#: Steps per timed block: about 0.1-0.4 s per block on a 2-core box.
BLOCK_STEPS = {8: 200, 32: 80, 64: 40, 128: 20, 256: 10}
#: Every ratio is to these, measured in the same rounds.
REFERENCES = ("sync", "async")
OURS = ("default", "boltz", "process")
BASELINES = ("sync", "async", "subproc", "dummy", "envpool", "pufferlib")
#: PufferLib's workers spin for 0.5 s after each step before they fall back to 10 ms naps: its
#: block starts with one untimed step (so they are awake, as in a training loop), and the next
#: block waits this long, so that no other implementation is timed against spinning workers.
SETTLE_S = {"pufferlib": 0.6}
_K_SUFFIX = re.compile(r"^(?P<kind>[a-z]+)-k(?P<k>[0-9]+)$")


class Skip(Exception):
    """The implementation cannot run here; the message says why."""


# --------------------------------------------------------------------------- names
def split_k(kind: str) -> tuple[str, int]:
    """``"boltz-k32"`` -> ``("boltz", 32)``; a name without ``-kK`` has K = 1.

    >>> split_k("boltz-k32"), split_k("default")
    (('boltz', 32), ('default', 1))
    """
    m = _K_SUFFIX.match(kind)
    if not m:
        return kind, 1
    k = int(m["k"])
    if k < 1:
        raise SystemExit(f"envs per sandbox must be >= 1 in {kind!r}")
    return m["kind"], k


def with_k(name: str, k: int) -> str:
    """``name`` at ``envs_per_sandbox=k``, options kept: ``with_k("default@0", 8) == "default-k8@0"``."""
    kind_end = min((i for i in (name.find("+"), name.find("@")) if i >= 0), default=len(name))
    kind, rest = name[:kind_end], name[kind_end:]
    return (kind if k == 1 else f"{kind}-k{k}") + rest


def is_ours(name: str) -> bool:
    return split_k(re.split(r"[+@]", name, maxsplit=1)[0])[0] in OURS


def expand_k(names: list[str], ks: list[int] | None) -> list[str]:
    """Each of ours without a ``-kK`` suffix once per K in ``ks`` (``None``: as given)."""
    if not ks:
        return list(names)
    out: list[str] = []
    for name in names:
        kind = re.split(r"[+@]", name, maxsplit=1)[0]
        if is_ours(name) and not _K_SUFFIX.match(kind):
            out.extend(with_k(name, k) for k in ks)
        else:
            out.append(name)
    return list(dict.fromkeys(out))


def parse_ks(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",") if x] if text else None


# --------------------------------------------------------------------------- implementations
class SB3Stepper:
    """An SB3 VecEnv behind the Gymnasium calls this script makes."""

    def __init__(self, venv, action_space):
        self.venv, self.action_space = venv, action_space

    def reset(self, seed=None):
        self.venv.seed(seed)
        return self.venv.reset()

    def step(self, actions):
        return self.venv.step(actions)

    def close(self):
        self.venv.close()


class EnvPoolStepper:
    """EnvPool's Gymnasium-style vector env (seeded at creation)."""

    def __init__(self, env):
        self.env, self.action_space = env, gym.vector.utils.batch_space(gym.spaces.Discrete(2), env.config["num_envs"])

    def reset(self, seed=None):
        return self.env.reset()

    def step(self, actions):
        return self.env.step(np.asarray(actions, dtype=np.int32))

    def close(self):
        self.env.close()


class PufferStepper:
    """PufferLib's Multiprocessing backend: one worker process per core, n / workers envs each."""

    def __init__(self, env, action_space):
        self.env, self.action_space = env, action_space

    def reset(self, seed=None):
        return self.env.reset(seed=seed or 0)

    def step(self, actions):
        return self.env.step(actions)

    def close(self):
        self.env.close()


def make_sb3(kind: str, factory, n: int):
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    cls = SubprocVecEnv if kind == "subproc" else DummyVecEnv
    return SB3Stepper(cls([factory] * n), gym.vector.utils.batch_space(factory().action_space, n))


def make_envpool(env_name: str, n: int, seed: int = 0):
    # (the workload first: installing envpool would not help a Python env, so say that, installed or not)
    if env_name != "cartpole":
        raise Skip("envpool runs only its own C++ envs; no Python-env workload")
    try:
        import envpool
    except Exception as exc:
        raise Skip(f"envpool not importable ({type(exc).__name__}: {exc}); pip install envpool") from None
    return EnvPoolStepper(envpool.make_gymnasium("CartPole-v1", num_envs=n, seed=seed))


def puffer_workers(n: int) -> int:
    """PufferLib's default cap: at most one worker per physical core, and a divisor of n."""
    import psutil

    cores = psutil.cpu_count(logical=False) or 1
    return max(w for w in range(1, min(cores, n) + 1) if n % w == 0)


def make_pufferlib(factory, n: int):
    try:
        import pufferlib.emulation
        import pufferlib.vector
    except Exception as exc:
        raise Skip(
            f"pufferlib not importable ({type(exc).__name__}: {exc}); the pufferlib sdist builds only with network "
            "access (it downloads raylib): pip install --no-deps pufferlib-core brings the same pufferlib.vector"
        ) from None
    env = pufferlib.vector.make(
        puffer_creator(factory), num_envs=n, num_workers=puffer_workers(n), backend=pufferlib.vector.Multiprocessing
    )
    return PufferStepper(env, gym.vector.utils.batch_space(factory().action_space, n))


def puffer_creator(factory):
    import pufferlib.emulation

    def creator(*args, **kwargs):
        return pufferlib.emulation.GymnasiumPufferEnv(env_creator=factory)

    return creator


def ours_kwargs(name: str) -> tuple[str, dict]:
    """The kind and the BoltzLabsVecEnv keywords of one of ours (``default-k8+hop@0``)."""
    kind, _, busy_poll = name.partition("@")
    kind, plus, option = kind.partition("+")
    if plus and option not in ("aslr", "hop", "bytes"):
        raise SystemExit(f"unknown option {option!r} in {name!r}: +aslr, +hop or +bytes")
    kind, k = split_k(kind)
    kwargs: dict = {"busy_poll_us": float(busy_poll)} if busy_poll else {}
    if k > 1:  # only then: K = 1 runs on versions without the keyword
        kwargs["envs_per_sandbox"] = k
    if option == "aslr":
        kwargs["env_aslr"] = True
    if option == "hop":
        kwargs["direct"] = False
    if option == "bytes":
        kwargs["shared_obs"] = False
    if kind == "boltz":
        kwargs["mode"] = "boltz"
    elif kind == "process":
        kwargs["isolation"] = "process"
    elif kind != "default":
        raise SystemExit(f"unknown implementation {name!r}: {', '.join(BASELINES + OURS)} (see --help)")
    return kind, kwargs


def make_impl(name: str, factory, n: int, env_name: str = "cartpole", seed: int = 0):
    """A vector env for ``name`` (see the module docstring); raises :class:`Skip` when it cannot run here."""
    if name == "async":
        return gym.vector.AsyncVectorEnv([factory] * n, shared_memory=True)
    if name == "sync":
        return gym.vector.SyncVectorEnv([factory] * n)
    if name in ("subproc", "dummy"):
        return make_sb3(name, factory, n)
    if name == "envpool":
        return make_envpool(env_name, n, seed)
    if name == "pufferlib":
        return make_pufferlib(factory, n)
    metrics = name.endswith("+metrics")
    _, kwargs = ours_kwargs(name[: -len("+metrics")] if metrics else name)
    if metrics:
        kwargs["metrics_port"] = 0
    try:
        env = BoltzLabsVecEnv([factory] * n, **kwargs)
        if metrics:
            _scrape_every_second(env.pool.metrics_url)
        return env
    except TypeError as exc:
        if "envs_per_sandbox" in str(exc):  # a version without envs_per_sandbox
            raise Skip(f"this boltzlabs_gym ({library_version()}) has no envs_per_sandbox: {exc}") from None
        raise


def _scrape_every_second(url: str) -> None:
    """Scrape ``url`` once a second on a daemon thread until the pool closes."""
    import threading
    import urllib.request

    def scrape() -> None:
        while True:
            try:
                urllib.request.urlopen(url, timeout=5).read()
            except OSError:
                return  # the pool closed
            time.sleep(1.0)

    threading.Thread(target=scrape, daemon=True).start()


def library_version() -> str:
    """Where boltzlabs_gym was imported from, and its git commit (for before/after runs)."""
    import subprocess

    import boltzlabs_gym

    root = os.path.dirname(os.path.dirname(os.path.abspath(boltzlabs_gym.__file__)))
    proc = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{root} at {proc.stdout.strip() or 'unknown commit'}"


# --------------------------------------------------------------------------- measurement
def start_all(names: list[str], factory, n: int, env_name: str, seed: int) -> tuple[dict, dict[str, str]]:
    """Every implementation that starts here, reset; and the reason for each that does not."""
    envs, skipped = {}, {}
    for name in names:
        t0 = time.perf_counter()
        try:
            env = make_impl(name, factory, n, env_name, seed)
        except Skip as exc:
            skipped[name] = str(exc)
            print(f"  skipped {name}: {exc}", file=sys.stderr, flush=True)
            continue
        envs[name] = env
        env.reset(seed=seed)
        print(f"  started {name} n={n} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return envs, skipped


def measure(
    names: list[str], factory, n: int, rounds: int, block: int, seed: int = 0, env_name: str = "cartpole"
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Seconds per block, per implementation, with every implementation alive at once; and the skipped."""
    envs, skipped = {}, {}
    try:
        envs, skipped = start_all(names, factory, n, env_name, seed)
        live = [name for name in names if name in envs]
        space = envs[live[0]].action_space
        space.seed(seed)
        actions = [space.sample() for _ in range(64)]
        for env in envs.values():
            for i in range(min(block, 50)):
                env.step(actions[i % 64])
        times: dict[str, list[float]] = {name: [] for name in live}
        for r in range(rounds):
            k = r % len(live)
            for name in live[k:] + live[:k]:
                times[name].append(time_block(name, envs[name], actions, r, block))
        return times, skipped
    finally:
        for env in envs.values():
            env.close()


def time_block(name: str, env, actions: list, r: int, block: int) -> float:
    """Seconds for ``block`` steps of ``env`` (round ``r`` picks the actions)."""
    settle = SETTLE_S.get(name, 0.0)
    if settle:
        env.step(actions[r % 64])
    t0 = time.perf_counter()
    for i in range(block):
        env.step(actions[(r + i) % 64])
    elapsed = time.perf_counter() - t0
    time.sleep(settle)
    return elapsed


def ratio_stats(ref: np.ndarray, t: np.ndarray) -> dict:
    ratio = ref / t
    return {
        "median": float(np.median(ratio)),
        "p25": float(np.percentile(ratio, 25)),
        "p75": float(np.percentile(ratio, 75)),
    }


def summarize(times: dict[str, list[float]], n: int, block: int, references=REFERENCES) -> list[dict]:
    """Env-steps/s per implementation and the per-round ratios to each reference."""
    rows = []
    for name, t in times.items():
        t = np.array(t)
        row = {"impl": name, "n": n, "steps_per_s": n * block * len(t) / t.sum(), "block_steps": block}
        for ref in references:
            if ref in times:
                row[f"vs_{ref}"] = ratio_stats(np.array(times[ref]), t)
        rows.append(row)
    return rows


def _cell(row: dict, ref: str) -> str:
    s = row.get(f"vs_{ref}")
    return "-" if s is None else f"{s['median']:.2f} ({s['p25']:.2f}-{s['p75']:.2f})"


def table_header(rounds: int) -> list[str]:
    return [
        f"| env | n | impl | env-steps/s | / SyncVectorEnv, median (p25-p75) of {rounds} rounds "
        "| / AsyncVectorEnv, median (p25-p75) |",
        "|---|---:|---|---:|---|---|",
    ]


def table_row(env_name: str, row: dict) -> str:
    return (
        f"| {env_name} | {row['n']} | {row['impl']} | {row['steps_per_s']:,.0f} | {_cell(row, 'sync')} "
        f"| {_cell(row, 'async')} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--env", choices=sorted(FACTORIES), default="cartpole")
    parser.add_argument("--sizes", default="8,64,256")
    parser.add_argument("--impls", default="async,default,boltz")
    parser.add_argument("--envs-per-sandbox", help="comma-separated K values to run each of ours at (e.g. 1,8,32)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=None, help="steps per timed block (default: by n)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows, skips and machine load to this JSON file")
    args = parser.parse_args(argv)
    names = [ref for ref in REFERENCES if ref not in args.impls.split(",")] + args.impls.split(",")
    names = expand_k(names, parse_ks(args.envs_per_sandbox))
    factory = FACTORIES[args.env]
    print("\n".join(table_header(args.rounds)))
    result: dict = {
        "env": args.env,
        "rounds": args.rounds,
        "impls": names,
        "rows": [],
        "skipped": {},
        "cpus": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
        "boltzlabs_gym": library_version(),
    }
    for n in (int(x) for x in args.sizes.split(",")):
        block = args.block or BLOCK_STEPS.get(n, max(1, 2000 // n))
        times, skipped = measure(names, factory, n, args.rounds, block, args.seed, args.env)
        result["skipped"].update(skipped)
        for row in summarize(times, n, block):
            result["rows"].append(row)
            print(table_row(args.env, row), flush=True)
    for name, reason in result["skipped"].items():
        print(f"skipped {name}: {reason}")
    result["loadavg_end"] = list(os.getloadavg())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
        f"boltzlabs_gym: {result['boltzlabs_gym']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
