"""Snapshot, restore and fork of a live CartPole-v1 env, beside a hard reset and a fresh start.

One run, both modes, on the machine at hand. Per mode, the median and p90 over ``--repeats``:

* ``snapshot``: ``envs.snapshot(0)`` until the handle is back (the env pickles itself and its
  workspace in its sandbox; the worker keeps the blob);
* ``restore 1``: ``envs.restore(snap, [1])`` until the batched ``(obs, infos)`` are back;
* ``fork 8``: ``envs.fork(0, into=[1..8])`` end to end (snapshot, restore into 8 slots, release);
* ``fork 8 fresh``: the same with ``fresh=True``: each of the 8 slots hard-reset first, so that every
  copy runs in a new process in a new sandbox;
* ``hard reset 1``: ``envs.pool.reset(where=[1], hard=True)``: kill, wipe and restart one env;
* ``fresh start``: a new vector env of one env, from ``make_vec`` until ``reset()`` returned (a
  worker and an env process started);
* ``held``: bytes one held snapshot costs (the blob the worker keeps), and the worker's PSS growth
  per snapshot over ``--held`` held snapshots.

    python benchmarks/snapshot.py [--repeats 50] [--held 200] [--out benchmarks/results/snapshot.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import psutil

import boltzlabs_gym

N = 9  # the source and 8 slots to fork into


def _ms(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[int(0.9 * (len(ordered) - 1))] * 1e3


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _worker_pss(envs) -> int:
    """PSS of the pool's local worker process (the one that holds the blobs)."""
    link = envs.pool._links[0]
    pid = link.call({"op": "ping"})["pid"]
    return psutil.Process(pid).memory_full_info().pss


def measure(mode: str, repeats: int, held: int) -> dict:
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=N, mode=mode)
    try:
        envs.reset(seed=0)
        for _ in range(20):
            envs.step(np.zeros(N, dtype=np.int64))  # the source is mid-episode, as in training
        envs.reset(seed=1)
        for _ in range(5):
            envs.step(np.ones(N, dtype=np.int64))
        snaps = []

        def take():
            snaps.append(envs.snapshot(0))

        t_snapshot = _timed(take, repeats)
        snap = snaps[0]
        t_restore = _timed(lambda: envs.restore(snap, [1]), repeats)
        t_fork = _timed(lambda: envs.fork(0, into=list(range(1, N))), repeats)
        t_fork_fresh = _timed(lambda: envs.fork(0, into=list(range(1, N)), fresh=True), max(5, repeats // 5))
        for s in snaps:
            s.release()
        mask = np.zeros(N, dtype=bool)
        mask[1] = True
        t_hard = _timed(lambda: envs.pool.reset(where=mask, hard=True), max(5, repeats // 5))
        before = _worker_pss(envs)
        kept = [envs.snapshot(0) for _ in range(held)]
        after = _worker_pss(envs)
        nbytes = kept[0].nbytes
        envs.pool.memory()
        pool_bytes = envs.pool.snapshot_bytes
        for s in kept:
            s.release()
    finally:
        envs.close()

    def fresh():
        e = boltzlabs_gym.make_vec("CartPole-v1", num_envs=1, mode=mode)
        e.reset(seed=0)
        e.close()

    t_fresh = _timed(fresh, max(3, repeats // 10))
    return {
        "mode": mode,
        "snapshot_ms": _ms(t_snapshot),
        "restore_1_ms": _ms(t_restore),
        "fork_8_ms": _ms(t_fork),
        "fork_8_fresh_ms": _ms(t_fork_fresh),
        "hard_reset_1_ms": _ms(t_hard),
        "fresh_start_ms": _ms(t_fresh),
        "held_bytes": nbytes,
        "held_pool_bytes_per_snapshot": pool_bytes / held,
        "worker_pss_per_snapshot_bytes": (after - before) / held,
    }


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Snapshot, restore and fork: CartPole-v1, one run",
        "",
        f"{meta['date']}, {meta['cpus']} CPUs, load average {meta['load']}, "
        f"{meta['repeats']} repeats (hard reset and fresh start fewer), {meta['held']} snapshots held for the memory figure.",
        "Median (p90) in ms.",
        "",
        "| mode | snapshot | restore 1 | fork 8 | fork 8 fresh | hard reset 1 | fresh start | held snapshot "
        "| worker PSS per held |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def cell(key):
            return f"{r[key][0]:.2f} ({r[key][1]:.2f})"

        lines.append(
            f"| {r['mode']} | {cell('snapshot_ms')} | {cell('restore_1_ms')} | {cell('fork_8_ms')} | "
            f"{cell('fork_8_fresh_ms')} | "
            f"{cell('hard_reset_1_ms')} | {cell('fresh_start_ms')} | {r['held_bytes'] / 1024:.1f} KiB | "
            f"{r['worker_pss_per_snapshot_bytes'] / 1024:.1f} KiB |"
        )
    lines += [
        "",
        "Targets (issue #22): snapshot <= 5 ms, restore into one slot <= 10 ms, fork into 8 slots <= 40 ms,",
        "a held snapshot <= 2 MiB. These are portable snapshots (the env's own state, pickled inside its",
        "sandbox); the copy-on-write and CRIU kinds are not built.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--held", type=int, default=200)
    parser.add_argument("--modes", nargs="+", default=["default", "boltz"])
    parser.add_argument("--out", default=None, help="write the table here (and the figures as .json beside it)")
    args = parser.parse_args(argv)
    rows = [measure(mode, args.repeats, args.held) for mode in args.modes]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "repeats": args.repeats,
        "held": args.held,
        "python": sys.version.split()[0],
    }
    text = render(rows, meta)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
