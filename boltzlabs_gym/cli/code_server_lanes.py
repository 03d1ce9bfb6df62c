"""Where ``boltzlabs-gym code-server`` puts its lanes: a local worker each (the default), pinned to
remote workers (``--workers``), or on a Ray cluster's nodes (``--ray``); the flags and the runner
they make.

With remote or Ray workers every lane runs on one worker (``--lanes-per-worker`` on each), so that a
lost worker takes its own lanes only: see :mod:`boltzlabs_gym.code.placement`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..code import CodeRunner

__all__ = ["add_lane_flags", "describe_lanes", "start_runner"]


def add_lane_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say where lanes run (beside ``--lanes`` and ``--workers``)."""
    group = p.add_argument_group("lanes beyond this host", "remote workers (--workers) or a Ray cluster (--ray)")
    group.add_argument(
        "--lanes-per-worker",
        type=int,
        default=None,
        help="with --workers or --ray: lanes on each worker, every lane on one worker "
        "(default: --lanes spread over the workers, at least one each)",
    )
    group.add_argument(
        "--ray", action="store_true", help="run the sandboxes on a Ray cluster: one worker per node (needs ray)"
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster's head, HOST:PORT (implies --ray; default with --ray: auto, the cluster on this host)",
    )
    group.add_argument("--ray-workers", type=int, default=None, help="workers on Ray (default: one per live node)")
    group.add_argument(
        "--ray-cpus-per-worker", type=float, default=1.0, help="CPUs each Ray worker's actor reserves (default 1)"
    )
    group.add_argument(
        "--placement-timeout",
        type=float,
        default=60.0,
        help="seconds Ray has to place the workers, at the start and for a replacement (default 60)",
    )


def start_runner(args: argparse.Namespace, settings: dict[str, Any]) -> tuple[CodeRunner, Callable[[], None]]:
    """The runner the flags ask for, and what closes it (and its workers)."""
    from ..code import CodeRunner
    from ..code.placement import lanes_on_workers, lanes_per_worker_for

    runner_settings: dict[str, Any] = dict(
        max_run_timeout=args.max_run_timeout,
        max_output_bytes=args.max_output_bytes,
        max_queue=args.max_queue,
        wipe=not args.no_wipe,
        python=None if getattr(args, "python", "auto") == "worker" else getattr(args, "python", "auto"),
        **settings,
    )
    on_ray = args.ray or args.ray_address is not None
    if on_ray and args.workers:
        raise SystemExit("code-server: --ray places its own workers; leave out --workers")
    if args.lanes_per_worker is not None and args.lanes_per_worker < 1:
        raise SystemExit(f"code-server: --lanes-per-worker must be >= 1, got {args.lanes_per_worker}")
    if on_ray:
        return _start_on_ray(args, runner_settings)
    if not args.workers:
        runner = CodeRunner(envs_per_lane=args.envs_per_lane, lanes=args.lanes, **runner_settings)
        return runner, runner.close
    per_worker = args.lanes_per_worker or lanes_per_worker_for(args.lanes, len(args.workers))
    runner = CodeRunner(
        envs_per_lane=args.envs_per_lane, lane_workers=lanes_on_workers(args.workers, per_worker), **runner_settings
    )
    return runner, runner.close


def _start_on_ray(args: argparse.Namespace, runner_settings: dict[str, Any]) -> tuple[CodeRunner, Callable[[], None]]:
    from ..ray.code_lanes import RayLanes

    lanes = RayLanes(
        address=args.ray_address or "auto",
        num_workers=args.ray_workers,
        lanes_per_worker=args.lanes_per_worker,
        total_lanes=args.lanes,
        envs_per_lane=args.envs_per_lane,
        cpus_per_worker=args.ray_cpus_per_worker,
        placement_timeout=args.placement_timeout,
        **runner_settings,
    )
    assert lanes.runner is not None  # (set once it started)
    return lanes.runner, lanes.close


def describe_lanes(runner: CodeRunner) -> str:
    """One line per lane: its number, where it runs, its envs (what the server prints at start)."""
    return "\n".join(f"  lane {lane.number}: {lane.envs} sandboxes on {lane.where}" for lane in runner.lanes())
