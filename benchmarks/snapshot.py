"""Snapshot, restore and fork of a live CartPole-v1 env, beside a hard reset and a fresh start.

One run, on the machine at hand: the portable kind in both modes, and the memory kind (a held fork
of the env, copy-on-write; boltz mode with the namespaces backend). Median and p90 over ``--repeats``:

* ``snapshot``: ``envs.snapshot(0, kind=...)`` until the handle is back. Portable: the env pickles
  itself and its workspace in its sandbox, the worker keeps the blob. Memory: the env forks its
  continuation into a nested sandbox and stays as the holder. A memory snapshot nests the source
  one namespace deeper, so before each one (untimed) env 0 is hard-reset, reset and stepped: every
  snapshot is a first-generation one, as when a training loop snapshots fresh episodes;
* ``restore 1``: ``envs.restore(snap, [1])`` until the batched ``(obs, infos)`` are back (memory: a
  copy forked from the holder, in its own namespaces, cgroup and workspace copy);
* ``fork 8``: ``envs.fork(0, into=[1..8], kind=...)`` end to end (snapshot, restore into 8 slots,
  release);
* ``fork 8 fresh``: portable only: ``fresh=True``, each of the 8 slots hard-reset first, so that every
  copy runs in a new process in a new sandbox (what a memory copy always is);
* ``hard reset 1``: ``envs.pool.reset(where=[1], hard=True)``: kill, wipe and restart one env;
* ``fresh start``: a new vector env of one env, from ``make_vec`` until ``reset()`` returned (a
  worker and an env process started);
* ``held``: what one held snapshot costs. Portable: the blob, and the worker's PSS growth per
  snapshot over ``--held`` held snapshots. Memory: the growth of the whole pool's PSS (worker,
  template, envs, holders) per held snapshot, with one snapshot of each of the 9 envs held.

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


def _worker_pid(envs) -> int:
    return envs.pool._links[0].call({"op": "ping"})["pid"]


def _worker_pss(envs) -> int:
    """PSS of the pool's local worker process (the one that holds the blobs)."""
    return psutil.Process(_worker_pid(envs)).memory_full_info().pss


def _tree_pss(envs) -> int:
    """PSS of the worker and every process under it (template, envs, holders)."""
    root = psutil.Process(_worker_pid(envs))
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total


def _fresh_source(envs) -> None:
    """Env 0 in a new process (a hard reset), mid-episode: its next memory snapshot is a first-generation one."""
    mask = np.zeros(N, dtype=bool)
    mask[0] = True
    envs.pool.reset(seed=1, where=mask, hard=True)
    envs.reset(seed=1, options={"reset_mask": mask})
    for _ in range(5):
        envs.step(np.ones(N, dtype=np.int64))


def measure(mode: str, kind: str, repeats: int, held: int) -> dict:
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=N, mode=mode)
    try:
        envs.reset(seed=0)
        for _ in range(20):
            envs.step(np.zeros(N, dtype=np.int64))  # the source is mid-episode, as in training
        envs.reset(seed=1)
        for _ in range(5):
            envs.step(np.ones(N, dtype=np.int64))
        snaps = []
        memory = kind == "memory"

        def timed_fresh(fn, count):  # each repeat from a first-generation source (memory kind)
            out = []
            for _ in range(count):
                if memory:
                    _fresh_source(envs)
                out += _timed(fn, 1)
            return out

        t_snapshot = timed_fresh(lambda: snaps.append(envs.snapshot(0, kind=kind)), repeats)
        snap = snaps[-1]
        assert snap.kind == kind, f"asked for a {kind} snapshot, got {snap.kind}"
        t_restore = _timed(lambda: envs.restore(snap, [1]), repeats)
        for s in snaps:
            s.release()
        t_fork = timed_fresh(lambda: envs.fork(0, into=list(range(1, N)), kind=kind), repeats)
        t_fork_fresh = []
        if not memory:
            t_fork_fresh = _timed(
                lambda: envs.fork(0, into=list(range(1, N)), fresh=True, kind=kind), max(5, repeats // 5)
            )
        mask = np.zeros(N, dtype=bool)
        mask[1] = True
        t_hard = _timed(lambda: envs.pool.reset(where=mask, hard=True), max(5, repeats // 5))
        if memory:  # one snapshot of each env, each its first generation
            envs.pool.reset(seed=2, hard=True)
            before = _tree_pss(envs)
            kept = [envs.snapshot(i, kind=kind) for i in range(N)]
            growth = (_tree_pss(envs) - before) / N
        else:
            before = _worker_pss(envs)
            kept = [envs.snapshot(0, kind=kind) for _ in range(held)]
            growth = (_worker_pss(envs) - before) / held
        nbytes = kept[0].nbytes
        envs.pool.memory()
        pool_bytes = envs.pool.snapshot_bytes / len(kept)
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
        "kind": kind,
        "snapshot_ms": _ms(t_snapshot),
        "restore_1_ms": _ms(t_restore),
        "fork_8_ms": _ms(t_fork),
        "fork_8_fresh_ms": _ms(t_fork_fresh) if t_fork_fresh else None,
        "hard_reset_1_ms": _ms(t_hard),
        "fresh_start_ms": _ms(t_fresh),
        "held_bytes": nbytes,
        "held_pool_bytes_per_snapshot": pool_bytes,
        "pss_growth_per_held_bytes": growth,
    }


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Snapshot, restore and fork: CartPole-v1, one run",
        "",
        f"{meta['date']}, {meta['cpus']} CPUs, load average {meta['load']}, "
        f"{meta['repeats']} repeats (hard reset and fresh start fewer), {meta['held']} portable snapshots held "
        "for the memory figure (memory kind: one per env, 9).",
        "Median (p90) in ms. Held: what the snapshot is counted as (the blob; a holder's PSS and workspace "
        "copy) and how much the measured PSS grew per held snapshot (portable: the worker's; memory: the "
        "whole pool's).",
        "",
        "| mode | kind | snapshot | restore 1 | fork 8 | fork 8 fresh | hard reset 1 | fresh start "
        "| held (counted) | PSS growth per held |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def cell(key):
            return "—" if r[key] is None else f"{r[key][0]:.2f} ({r[key][1]:.2f})"

        lines.append(
            f"| {r['mode']} | {r['kind']} | {cell('snapshot_ms')} | {cell('restore_1_ms')} | {cell('fork_8_ms')} | "
            f"{cell('fork_8_fresh_ms')} | "
            f"{cell('hard_reset_1_ms')} | {cell('fresh_start_ms')} | {r['held_bytes'] / 1024:.1f} KiB | "
            f"{r['pss_growth_per_held_bytes'] / 1024:.1f} KiB |"
        )
    lines += [
        "",
        "Targets: snapshot <= 5 ms, restore into one slot <= 10 ms, fork into 8 slots <= 40 ms",
        "(each copy in its own sandbox), a held in-memory snapshot <= 2 MiB PSS. A memory copy is always a new",
        "process in new namespaces, a new cgroup and a workspace copy; a portable restore loads the state into",
        "the slot's existing process (fresh=True: into a new one, after a hard reset).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--held", type=int, default=200)
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["default:portable", "default:memory", "boltz:portable", "boltz:memory"],
        help="mode:kind pairs to measure",
    )
    parser.add_argument("--out", default=None, help="write the table here (and the figures as .json beside it)")
    args = parser.parse_args(argv)
    rows = [measure(*run.split(":"), args.repeats, args.held) for run in args.runs]
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
