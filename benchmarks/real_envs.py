#!/usr/bin/env python
"""Real envs side by side: HalfCheetah-v5 (MuJoCo) and Atari Pong, every vectorizer, one configuration.

    python benchmarks/real_envs.py                                  # both envs, n = 16 and 64, every implementation
    python benchmarks/real_envs.py --envs pong --sizes 64 --k 8,32 --rounds 5
    python benchmarks/real_envs.py --smoke --out /tmp/r             # tiny: n = 2, a few steps (what a test runs)

One env configuration for every implementation, printed at the top of the output
(``real_env_factories.py``): Pong is ``gym.make("ALE/Pong-v5", frameskip=1)`` (sticky actions,
``repeat_action_probability=0.25``) under ``AtariPreprocessing(frame_skip=4, screen_size=84,
grayscale_obs=True, noop_max=30)`` and ``FrameStackObservation(4)``; HalfCheetah-v5 has its
defaults. EnvPool runs its own C++ versions with the nearest options; the differences that remain
are printed beside the configuration.

Implementations (``--impls``): ``sync`` (Gymnasium SyncVectorEnv), ``async`` (AsyncVectorEnv,
shared memory, its default context), ``subproc`` (SB3 SubprocVecEnv, its default start method,
forkserver, with what its workers import preloaded, as paired.py and run.py do), ``envpool``,
and ours: ``default`` and ``boltz`` (BoltzLabsVecEnv, ``mode="default"`` / ``mode="boltz"``), each at
K = 1 (one env per sandbox) and at every K of ``--k`` (``envs_per_sandbox=K``; ``auto``, the default,
is ``n // os.cpu_count()``: one sandbox per core). An implementation that cannot run (not installed)
is skipped with the reason.

Every implementation of an (env, n) is started, reset and warmed up, and stays alive; then
``--rounds`` rounds each time one block of ``--steps`` steps of every implementation in turn, the
order rotating each round, so that a machine whose speed drifts within minutes (a shared VM) drifts
under all of them alike (``--one-at-a-time`` instead runs each alone and closes it before the next
starts). Each gets the same pre-sampled actions (sampling is not timed) and ``--warmup`` untimed
steps: env-steps/s is the median over its blocks (p25-p75 beside it), the ratios are that median
over AsyncVectorEnv's and SyncVectorEnv's
at the same n. Start+reset is the time from construction to the end of the first ``reset(seed=)``.
Markdown on stdout (progress on stderr); ``real_envs.json`` and ``real_envs.md`` (command, date,
commit, machine, load) in ``--out`` (default ``benchmarks/results``; ``--smoke`` writes only where
``--out`` says).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import cloudpickle  # noqa: E402
import gymnasium as gym  # noqa: E402
import machine  # noqa: E402
import numpy as np  # noqa: E402
import real_env_factories as factories  # noqa: E402

cloudpickle.register_pickle_by_value(factories)  # sandboxes cannot import this directory
# SB3's SubprocVecEnv starts its workers from a forkserver: preload what they import (as run.py does).
mp.set_forkserver_preload(["stable_baselines3.common.vec_env", "gymnasium", "numpy", "real_env_factories"])

ENVS = ("halfcheetah", "pong")
IMPLS = ("sync", "async", "subproc", "envpool", "default", "boltz")
LABELS = {"sync": "SyncVectorEnv", "async": "AsyncVectorEnv", "subproc": "SubprocVecEnv", "envpool": "EnvPool"}
GYM_CONFIG = {"halfcheetah": factories.HALF_CHEETAH_CONFIG, "pong": factories.PONG_CONFIG}
ENVPOOL_IDS = {"halfcheetah": "HalfCheetah-v5", "pong": "Pong-v5"}
#: EnvPool's options nearest to the Gymnasium configuration (passed explicitly, defaults included).
ENVPOOL_OPTIONS = {
    "pong": dict(
        episodic_life=False,
        reward_clip=False,
        repeat_action_probability=0.25,
        noop_max=30,
        stack_num=4,
        frame_skip=4,
        img_height=84,
        img_width=84,
        gray_scale=True,
        use_inter_area_resize=True,  # cv2.INTER_AREA, as AtariPreprocessing resizes
        use_fire_reset=False,  # AtariPreprocessing presses no FIRE on reset
        full_action_space=False,
        max_episode_steps=27000,  # ALE v5's 108,000 frames / frame_skip 4
    ),
    "halfcheetah": dict(max_episode_steps=1000),
}
#: What still differs between EnvPool's env and the Gymnasium configuration (printed with the config).
ENVPOOL_DIFFERENCES = {
    "pong": [
        "EnvPool's own C++ preprocessing over its bundled ALE, seeded by its own generator (seed + env index): "
        "same distributions, not the same trajectories",
        "no-ops on reset: both draw 1..30 NOOPs; EnvPool from its C++ generator, AtariPreprocessing from the "
        "env's np_random",
        "max-pooling: both take the max of the last two frames of a 4-frame step; when an episode ends within "
        "a step EnvPool keeps the last frame alone, AtariPreprocessing still takes the max of its two buffers",
        "autoreset: EnvPool resets a finished env on its next step (as NEXT_STEP); its infos are its own "
        "(env_id, lives, reward, terminated, elapsed_step)",
    ],
    "halfcheetah": [
        "EnvPool's own C++ HalfCheetah-v5 on the MuJoCo it bundles (not the installed mujoco), reset noise "
        "from its own generator: same model and defaults (frame_skip 5, 1000 steps), not the same trajectories",
    ],
}


class Skip(Exception):
    """The implementation cannot run here; the message says why."""


# --------------------------------------------------------------------------- implementations
class SB3Stepper:
    """SB3's SubprocVecEnv behind the calls this script makes."""

    def __init__(self, venv):
        self.venv = venv

    def reset(self, seed=None):
        self.venv.seed(seed)
        return self.venv.reset()

    def step(self, actions):
        return self.venv.step(actions)

    def close(self):
        self.venv.close()


class EnvPoolStepper:
    """EnvPool's Gymnasium-style vector env (seeded at creation)."""

    def __init__(self, env, action_dtype):
        self.env, self.action_dtype = env, action_dtype

    def reset(self, seed=None):
        return self.env.reset()

    def step(self, actions):
        return self.env.step(np.asarray(actions, dtype=self.action_dtype))

    def close(self):
        self.env.close()


def split_k(name: str) -> tuple[str, int]:
    """``"boltz-k32"`` -> ``("boltz", 32)``; a name without ``-kK`` has K = 1."""
    kind, sep, k = name.partition("-k")
    return (kind, int(k)) if sep and k.isdigit() else (name, 1)


def label(name: str) -> str:
    return LABELS.get(name, name)


def make_impl(name: str, env_name: str, n: int, seed: int):
    """A started vector env for ``name``; raises :class:`Skip` when it cannot run here."""
    factory = factories.FACTORIES[env_name]
    if name == "sync":
        return gym.vector.SyncVectorEnv([factory] * n)
    if name == "async":
        return gym.vector.AsyncVectorEnv([factory] * n, shared_memory=True)
    if name == "subproc":
        try:
            from stable_baselines3.common.vec_env import SubprocVecEnv
        except Exception as exc:
            raise Skip(
                f"stable_baselines3 not importable ({type(exc).__name__}: {exc}); pip install stable-baselines3"
            ) from None
        return SB3Stepper(SubprocVecEnv([factory] * n))
    if name == "envpool":
        try:
            import envpool
        except Exception as exc:
            raise Skip(f"envpool not importable ({type(exc).__name__}: {exc}); pip install envpool") from None
        env = envpool.make_gymnasium(ENVPOOL_IDS[env_name], num_envs=n, seed=seed, **ENVPOOL_OPTIONS[env_name])
        return EnvPoolStepper(env, env.action_space.dtype)
    kind, k = split_k(name)
    if kind not in ("default", "boltz"):
        raise SystemExit(f"unknown implementation {name!r}: {', '.join(IMPLS)}, ours with -kK")
    from boltzlabs_gym import BoltzLabsVecEnv

    return BoltzLabsVecEnv([factory] * n, mode=kind, envs_per_sandbox=k)


def expand(impls: list[str], ks: list[str], n: int) -> list[str]:
    """Ours at K = 1 and at each K of ``ks`` (``auto``: one sandbox per core), K <= n, no repeats."""
    chosen = []
    for k in ks:
        value = max(1, n // (os.cpu_count() or 1)) if k == "auto" else int(k)
        if value > n:
            print(f"  K={value} > n={n}: left out", file=sys.stderr)
            continue
        chosen.append(value)
    out: list[str] = []
    for name in impls:
        if name in ("default", "boltz"):
            out.append(name)
            out.extend(f"{name}-k{k}" for k in chosen if k > 1)
        else:
            out.append(name)
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------- measurement
def pre_sampled_actions(env_name: str, n: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches of random actions, drawn once and given to every implementation."""
    env = factories.FACTORIES[env_name]()
    try:
        space = gym.vector.utils.batch_space(env.action_space, n)
    finally:
        env.close()
    space.seed(seed)
    return [space.sample() for _ in range(count)]


def measure(name: str, env_name: str, n: int, actions: list, args) -> dict:
    """One implementation: start+reset time, then ``args.rounds`` timed blocks; always closed."""
    row: dict = {"env": env_name, "n": n, "impl": name, "label": label(name)}
    kind, k = split_k(name)
    if kind in ("default", "boltz"):
        row.update(mode=kind, envs_per_sandbox=k)
    t0 = time.perf_counter()
    env = None
    try:
        env = make_impl(name, env_name, n, args.seed)
        env.reset(seed=args.seed)
        row["start_reset_s"] = time.perf_counter() - t0
        if hasattr(env, "pool"):
            row["isolation"] = str(env.pool.isolation).split(" ")[0]
        step = 0
        for _ in range(args.warmup):
            env.step(actions[step % len(actions)])
            step += 1
        per_round = []
        for _ in range(args.rounds):
            t1 = time.perf_counter()
            for _ in range(args.steps):
                env.step(actions[step % len(actions)])
                step += 1
            per_round.append(n * args.steps / (time.perf_counter() - t1))
        row.update(
            status="ok",
            steps_per_s=float(np.median(per_round)),
            p25=float(np.percentile(per_round, 25)),
            p75=float(np.percentile(per_round, 75)),
            rounds_steps_per_s=per_round,
        )
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # reported, not fatal: the next implementation still runs
        row.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
    finally:
        if env is not None:
            env.close()
    return row


def measure_interleaved(names: list[str], env_name: str, n: int, actions: list, args) -> list[dict]:
    """Every implementation started (one after another, each timed from construction to its first
    reset) and kept alive; then ``args.rounds`` rounds, each timing one block of every
    implementation in turn (the order rotating by one each round), so that a machine whose speed
    drifts within minutes drifts under all of them alike. Every one closed at the end."""
    rows, envs = [], []
    try:
        for name in names:
            row: dict = {"env": env_name, "n": n, "impl": name, "label": label(name)}
            kind, k = split_k(name)
            if kind in ("default", "boltz"):
                row.update(mode=kind, envs_per_sandbox=k)
            rows.append(row)
            env = None
            try:
                t0 = time.perf_counter()
                env = make_impl(name, env_name, n, args.seed)
                env.reset(seed=args.seed)
                row["start_reset_s"] = time.perf_counter() - t0
                if hasattr(env, "pool"):
                    row["isolation"] = str(env.pool.isolation).split(" ")[0]
                for step in range(args.warmup):
                    env.step(actions[step % len(actions)])
                row.update(status="ok", rounds_steps_per_s=[])
            except Skip as exc:
                row.update(status="skipped", reason=str(exc))
            except Exception as exc:  # reported, not fatal: the others still run
                row.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
            if row["status"] != "ok" and env is not None:
                env.close()
                env = None
            envs.append(env)
        live = [i for i, env in enumerate(envs) if env is not None]
        step = args.warmup
        for r in range(args.rounds):
            for i in live[r % len(live) :] + live[: r % len(live)] if live else []:
                try:
                    t1 = time.perf_counter()
                    for s in range(args.steps):
                        envs[i].step(actions[(step + s) % len(actions)])
                    rows[i]["rounds_steps_per_s"].append(n * args.steps / (time.perf_counter() - t1))
                except Exception as exc:  # this one failed mid-run: reported, the others go on
                    rows[i].update(status="failed", reason=f"{type(exc).__name__}: {exc}")
                    envs[i].close()
                    envs[i] = None
                    live.remove(i)
            step += args.steps
        for row in rows:
            per_round = row.get("rounds_steps_per_s")
            if row["status"] == "ok" and per_round:
                row.update(
                    steps_per_s=float(np.median(per_round)),
                    p25=float(np.percentile(per_round, 25)),
                    p75=float(np.percentile(per_round, 75)),
                )
    finally:
        for env in envs:
            if env is not None:
                env.close()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Each row's median over AsyncVectorEnv's and SyncVectorEnv's at the same (env, n)."""
    for row in rows:
        for ref in ("async", "sync"):
            base = next(
                (r for r in rows if (r["env"], r["n"], r["impl"], r["status"]) == (row["env"], row["n"], ref, "ok")),
                None,
            )
            if base is not None and row.get("status") == "ok":
                row[f"vs_{ref}"] = row["steps_per_s"] / base["steps_per_s"]


# --------------------------------------------------------------------------- output
def config_lines(envs: list[str]) -> list[str]:
    lines = ["## Configuration (the same for every implementation)", ""]
    for env_name in envs:
        lines.append(f"- **{env_name}**: {GYM_CONFIG[env_name]}")
        options = ", ".join(f"{k}={v}" for k, v in ENVPOOL_OPTIONS[env_name].items())
        lines.append(f"  - EnvPool: `envpool.make_gymnasium({ENVPOOL_IDS[env_name]!r}, {options})`; still different:")
        lines.extend(f"    - {d}" for d in ENVPOOL_DIFFERENCES[env_name])
    return lines


def table_lines(rows: list[dict], rounds: int) -> list[str]:
    lines = [
        f"| env | n | impl | env-steps/s, median of {rounds} (p25-p75) | / AsyncVectorEnv | / SyncVectorEnv "
        "| start+reset s |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['env']} | {r['n']} | {r['label']} | {r['status']}: {r['reason']} | | | |")
            continue
        ratios = [f"{r[f'vs_{ref}']:.2f}x" if f"vs_{ref}" in r else "-" for ref in ("async", "sync")]
        lines.append(
            f"| {r['env']} | {r['n']} | {r['label']} | {r['steps_per_s']:,.0f} ({r['p25']:,.0f}-{r['p75']:,.0f}) "
            f"| {ratios[0]} | {ratios[1]} | {r['start_reset_s']:.1f} |"
        )
    return lines


def machine_info() -> dict:
    versions = machine.package_versions(
        (
            "boltzlabs-gym",
            "gymnasium",
            "numpy",
            "ale-py",
            "mujoco",
            "opencv-python-headless",
            "envpool",
            "stable-baselines3",
        )
    )
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return dict(
        cpu_count=os.cpu_count(),
        cpu_model=machine.cpu_model(),
        mem_total_gib=machine.mem_total_gib(),
        python=sys.version.split()[0],
        platform=platform.platform(),
        versions=versions,
        git_commit=commit or None,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--envs", default=",".join(ENVS), help=f"comma-separated subset of {','.join(ENVS)}")
    parser.add_argument("--sizes", default="16,64", help="comma-separated env counts n")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument(
        "--k", default="auto", help="comma-separated envs_per_sandbox values for ours besides K=1; auto: n // CPUs"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed blocks per implementation")
    parser.add_argument("--steps", type=int, help="steps per timed block (default: 3200 // n, at least 20)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before the first block")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="folder for real_envs.json and real_envs.md (default benchmarks/results)")
    parser.add_argument("--smoke", action="store_true", help="n=2, a few steps, K=1 and 2: a run, not a measurement")
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run each implementation alone, closed before the next starts (default: all alive, rounds interleaved)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.k, args.rounds, args.steps, args.warmup = "2", "2", 1, 3, 1
    out_dir = args.out or (None if args.smoke else os.path.join(HERE, "results"))
    envs = [e for e in args.envs.split(",") if e]
    for env_name in envs:
        if env_name not in ENVS:
            raise SystemExit(f"unknown env {env_name!r}: {', '.join(ENVS)}")
    sizes = [int(x) for x in args.sizes.split(",") if x]
    impls = [i for i in args.impls.split(",") if i]
    ks = [k for k in args.k.split(",") if k]

    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    result: dict = {
        "command": command,
        "machine": machine_info(),
        "loadavg_start": list(os.getloadavg()),
        "config": {e: GYM_CONFIG[e] for e in envs},
        "envpool_options": {e: ENVPOOL_OPTIONS[e] for e in envs},
        "envpool_differences": {e: ENVPOOL_DIFFERENCES[e] for e in envs},
        "rounds": args.rounds,
        "warmup": args.warmup,
        "seed": args.seed,
        "smoke": args.smoke,
        "interleaved": not args.one_at_a_time,
        "rows": [],
    }
    m = result["machine"]
    head = [
        "# Real envs: HalfCheetah-v5 and Atari Pong, every vectorizer",
        "",
        f"- command: `{command}`",
        f"- date: {m['date']}, git {str(m['git_commit'])[:10]}",
        f"- machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {m['mem_total_gib']} GiB, Python {m['python']}; "
        f"load average {result['loadavg_start'][0]:.1f} at the start",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
        "",
        *config_lines(envs),
        "",
    ]
    if args.smoke:
        head += ["**Smoke run: n=2, a few steps. The figures below are not measurements.**", ""]
    print("\n".join(head), flush=True)

    for env_name in envs:
        modules, install = factories.REQUIREMENTS[env_name]
        missing = [mod for mod in modules if not _importable(mod)]
        for n in sizes:
            steps = args.steps or max(20, 3200 // n)
            run_args = argparse.Namespace(**{**vars(args), "steps": steps})
            actions = pre_sampled_actions(env_name, n, 64, args.seed) if not missing else []
            names = expand(impls, ks, n)
            if not missing and not args.one_at_a_time:
                rows = measure_interleaved(names, env_name, n, actions, run_args)
            else:
                rows = []
                for name in names:
                    if missing and name != "envpool":
                        row = dict(env=env_name, n=n, impl=name, label=label(name), status="skipped")
                        row["reason"] = f"{', '.join(missing)} not importable: {install}"
                    elif missing:
                        row = measure(name, env_name, n, _envpool_actions(env_name, n, args.seed), run_args)
                    else:
                        row = measure(name, env_name, n, actions, run_args)
                    rows.append(row)
            for row in rows:
                row["steps_per_block"] = steps
                result["rows"].append(row)
                done = f"{row['steps_per_s']:,.0f} steps/s" if row["status"] == "ok" else row["status"]
                print(f"  {env_name} n={n} {row['impl']}: {done}", file=sys.stderr, flush=True)
    add_ratios(result["rows"])
    result["loadavg_end"] = list(os.getloadavg())
    table = table_lines(result["rows"], args.rounds)
    tail = ["", f"load average {result['loadavg_end'][0]:.1f} at the end"]
    print("\n".join(table + tail), flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "real_envs.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out_dir, "real_envs.md"), "w") as f:
            f.write("\n".join(head + table + tail) + "\n")
        print(f"wrote {out_dir}/real_envs.json, real_envs.md", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in result["rows"]) else 0


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _envpool_actions(env_name: str, n: int, seed: int) -> list[np.ndarray]:
    """Actions for EnvPool alone (the Gymnasium env cannot be built here to sample from)."""
    space = {"pong": gym.spaces.Discrete(6), "halfcheetah": gym.spaces.Box(-1.0, 1.0, (6,), np.float32)}[env_name]
    batched = gym.vector.utils.batch_space(space, n)
    batched.seed(seed)
    return [batched.sample() for _ in range(64)]


if __name__ == "__main__":
    sys.exit(main())
