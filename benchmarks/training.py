"""Training, not just stepping: wall time and the return reached, per vectorizer, on real envs.

Two workloads, each run once per vectorizer with the same seed, hyperparameters and step
budget, one after the other (order rotated per repeat):

* ``sb3``: Stable-Baselines3 PPO on a MuJoCo env (default InvertedPendulum-v5) over SB3's
  ``DummyVecEnv`` (``dummy``) and ``SubprocVecEnv`` (``subproc``) and ours,
  ``BoltzLabsSB3VecEnv`` (``boltzlabs``: mode="default"; ``boltzlabs_boltz``: mode="boltz";
  either with ``-kK`` for ``envs_per_sandbox=K``). Reports learn wall time, env-steps/s, the
  mean return of the last episodes (SB3's Monitor) and a deterministic evaluation on a plain
  ``gym.make`` env after training.
* ``atari``: a CleanRL-style PPO (Nature CNN, GAE, clipped objective), written here, on
  ALE Breakout over Gymnasium's ``SyncVectorEnv`` (``sync``) and ``AsyncVectorEnv``
  (``async``) and ours, ``BoltzLabsVecEnv`` (``boltzlabs``, ``boltzlabs_boltz``, ``-kK``),
  all with Gymnasium 1.x's default NEXT_STEP autoreset. Reports wall time, env-steps/s and
  the mean episodic return (RecordEpisodeStatistics inside each env).

Both print a random policy's mean return as the reference::

    PYTHONPATH=$PWD python benchmarks/training.py --smoke                 # tiny budgets (CI)
    PYTHONPATH=$PWD python benchmarks/training.py --workloads sb3 --sb3-timesteps 50000
    PYTHONPATH=$PWD python benchmarks/training.py --workloads atari --atari-timesteps 100000

Writes ``training-<date>.json`` and ``.md`` (command, date, commit, machine, every row)
into ``--out`` (default ``benchmarks/results/``; with ``--smoke``, a temporary directory).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import multiprocessing as mp
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import cloudpickle  # noqa: E402
import gymnasium as gym  # noqa: E402
import machine  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import training_envs  # noqa: E402
from torch import nn  # noqa: E402

# The sandboxes and AsyncVectorEnv's workers cannot import this directory: ship by value.
cloudpickle.register_pickle_by_value(training_envs)
# SubprocVecEnv starts its workers with forkserver: preload what they import, as run.py does.
mp.set_forkserver_preload(["stable_baselines3.common.vec_env", "gymnasium", "numpy"])

OURS = ("boltzlabs", "boltzlabs_boltz")

# Smoke budgets: every vectorizer of both workloads in well under a minute of CPU each.
SMOKE = dict(
    sb3_timesteps=256,
    sb3_n_envs=2,
    sb3_update=128,
    sb3_kinds="dummy,subproc,boltzlabs,boltzlabs_boltz-k2",
    atari_timesteps=512,
    atari_n_envs=2,
    atari_n_steps=32,
    atari_kinds="sync,async,boltzlabs,boltzlabs_boltz-k2",
    eval_episodes=1,
    random_episodes=2,
)


def split_k(kind: str) -> tuple[str, int]:
    """``"boltzlabs_boltz-k4"`` -> ``("boltzlabs_boltz", 4)``; no suffix: K = 1."""
    base, sep, k = kind.rpartition("-k")
    return (base, int(k)) if sep and k.isdigit() else (kind, 1)


def ours_settings(kind: str, isolation: str) -> dict:
    base, k = split_k(kind)
    settings = {"isolation": isolation, "mode": "boltz" if base == "boltzlabs_boltz" else "default"}
    if k > 1:
        settings["envs_per_sandbox"] = k
    return settings


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- sb3 / MuJoCo
def sb3_build(kind: str, args):
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    from boltzlabs_gym.sb3 import make_sb3_vec_env

    if split_k(kind)[0] in OURS:
        return make_sb3_vec_env(
            args.mujoco_env, n_envs=args.sb3_n_envs, seed=args.seed, **ours_settings(kind, args.isolation)
        )
    cls = {"dummy": DummyVecEnv, "subproc": SubprocVecEnv}[kind]
    return make_vec_env(args.mujoco_env, n_envs=args.sb3_n_envs, seed=args.seed, vec_env_cls=cls)


def sb3_hyperparameters(args) -> dict:
    """SB3's PPO defaults (the PPO paper's MuJoCo settings), one update of ``--sb3-update`` samples
    whatever the number of envs: ``n_steps = update // n_envs``."""
    return dict(
        n_steps=max(1, args.sb3_update // args.sb3_n_envs),
        batch_size=min(64, args.sb3_update),
        n_epochs=10,
        learning_rate=3e-4,
        gamma=0.99,
        gae_lambda=0.95,
        clip_range=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
    )


def sb3_run(kind: str, args) -> dict:
    from stable_baselines3 import PPO
    from stable_baselines3.common.logger import Logger

    seed_everything(args.seed)
    t_build = time.perf_counter()
    env = sb3_build(kind, args)
    build_s = time.perf_counter() - t_build
    try:
        model = PPO("MlpPolicy", env, seed=args.seed, device="cpu", verbose=0, **sb3_hyperparameters(args))
        model.set_logger(Logger(folder=None, output_formats=[]))  # no /tmp/SB3-<time> folder per model
        t0 = time.perf_counter()
        model.learn(args.sb3_timesteps)
        wall = time.perf_counter() - t0
        episodes = [float(e["r"]) for e in model.ep_info_buffer]
        faults = ours_faults(env)
    finally:
        env.close()
    eval_returns = sb3_evaluate(model, args)
    last = episodes[-args.last_n :]
    return dict(
        workload="sb3",
        kind=kind,
        build_s=build_s,
        wall_s=wall,
        steps=int(model.num_timesteps),
        sps=model.num_timesteps / wall,
        episodes=len(episodes),
        ret_last=float(np.mean(last)) if last else float("nan"),
        eval_ret=float(np.mean(eval_returns)),
        eval_returns=eval_returns,
        **faults,
    )


def ours_faults(env) -> dict:
    """Ours: the sandbox in force and the env-steps that failed (straggler or crash: those episodes
    were truncated, so the run no longer follows the others); empty for the other vectorizers."""
    venv = getattr(env, "venv", None)
    if venv is None or not hasattr(venv, "isolation"):
        return {}
    return dict(isolation=sandbox(venv.isolation), stragglers=env.straggler_count, errors=env.error_count)


def sandbox(report) -> str:
    """``namespaces``, ``bwrap`` or ``process``, with its missing properties if any."""
    missing = ",".join(report.missing)
    return report.backend + (f" (missing: {missing})" if missing else "")


def sb3_evaluate(model, args) -> list[float]:
    """The trained policy, deterministic, on a plain ``gym.make`` env (seeds 10_000 + episode)."""
    env = gym.make(args.mujoco_env)
    returns = []
    try:
        for ep in range(args.eval_episodes):
            obs, _ = env.reset(seed=10_000 + ep)
            total, done = 0.0, False
            while not done:
                action, _ = model.predict(obs, deterministic=True)
                obs, reward, term, trunc, _ = env.step(action)
                total += float(reward)
                done = term or trunc
            returns.append(total)
    finally:
        env.close()
    return returns


def random_returns(make, episodes: int, seed: int) -> list[float]:
    """Mean return of uniformly random actions: the reference a trained policy must clear."""
    env = make()
    env.action_space.seed(seed)
    returns = []
    try:
        for ep in range(episodes):
            env.reset(seed=seed + ep)
            total, done = 0.0, False
            while not done:
                _, reward, term, trunc, _ = env.step(env.action_space.sample())
                total += float(reward)
                done = term or trunc
            returns.append(total)
    finally:
        env.close()
    return returns


# --------------------------------------------------------------------------- atari / CleanRL-style PPO
def layer(module: nn.Module, std: float = float(np.sqrt(2)), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(module.weight, std)
    nn.init.constant_(module.bias, bias)
    return module


class NatureAgent(nn.Module):
    """The Nature DQN torso with a policy head and a value head (orthogonal init, as CleanRL)."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.torso = nn.Sequential(
            layer(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.pi = layer(nn.Linear(512, n_actions), std=0.01)
        self.v = layer(nn.Linear(512, 1), std=1.0)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.v(self.torso(obs / 255.0)).squeeze(-1)

    def act(self, obs: torch.Tensor, action: torch.Tensor | None = None):
        hidden = self.torso(obs / 255.0)
        dist = torch.distributions.Categorical(logits=self.pi(hidden))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.v(hidden).squeeze(-1)


def atari_build(kind: str, args):
    fns = [functools.partial(training_envs.make_atari, args.atari_env) for _ in range(args.atari_n_envs)]
    if split_k(kind)[0] in OURS:
        from boltzlabs_gym import BoltzLabsVecEnv

        return BoltzLabsVecEnv(fns, **ours_settings(kind, args.isolation))
    cls = {"sync": gym.vector.SyncVectorEnv, "async": gym.vector.AsyncVectorEnv}[kind]
    return cls(fns)


def gae(rewards, values, next_value, terms, dones, gamma: float, lam: float):
    """Advantages of a NEXT_STEP rollout. Step t's successor state is obs[t + 1] (or the obs
    after the rollout): after a done step that is the episode's final observation, not yet
    reset, so a truncated step bootstraps from its value and a terminated one does not; the
    chain of advantages stops at every done step."""
    adv = np.zeros_like(rewards)
    last = np.zeros_like(next_value)
    for t in reversed(range(len(rewards))):
        nxt = next_value if t == len(rewards) - 1 else values[t + 1]
        delta = rewards[t] + gamma * nxt * (1.0 - terms[t]) - values[t]
        last = delta + gamma * lam * (1.0 - dones[t]) * last
        adv[t] = last
    return adv


def atari_run(kind: str, args) -> dict:
    seed_everything(args.seed)
    t_build = time.perf_counter()
    envs = atari_build(kind, args)
    build_s = time.perf_counter() - t_build
    n, T = args.atari_n_envs, args.atari_n_steps
    updates = max(1, args.atari_timesteps // (n * T))
    agent = NatureAgent(int(envs.single_action_space.n))
    optim = torch.optim.Adam(agent.parameters(), lr=args.atari_lr, eps=1e-5)
    obs_buf = np.zeros((T, n, *envs.single_observation_space.shape), dtype=np.uint8)
    actions, logps, rewards, values = (np.zeros((T, n), dtype=np.float32) for _ in range(4))
    terms, dones = np.zeros((T, n), dtype=np.float32), np.zeros((T, n), dtype=np.float32)
    valid = np.ones((T, n), dtype=bool)
    episodes: list[float] = []
    faults = {"stragglers": 0, "errors": 0}
    try:
        t0 = time.perf_counter()
        next_obs, _ = envs.reset(seed=args.seed)
        autoreset = np.zeros(n, dtype=bool)  # NEXT_STEP: these envs' next step is a reset
        for update in range(updates):
            for group in optim.param_groups:  # linear annealing, as CleanRL
                group["lr"] = args.atari_lr * (1.0 - update / updates)
            for t in range(T):
                obs_buf[t] = next_obs
                valid[t] = ~autoreset  # a reset step's transition (final obs -> first obs) is no transition
                with torch.no_grad():
                    action, logp, _, value = agent.act(torch.as_tensor(next_obs))
                actions[t], logps[t], values[t] = action.numpy(), logp.numpy(), value.numpy()
                next_obs, reward, term, trunc, infos = envs.step(action.numpy())
                rewards[t] = np.sign(reward)  # clipped for learning; the reported return is the game score
                terms[t], autoreset = term, np.logical_or(term, trunc)
                dones[t] = autoreset
                if "episode" in infos:
                    episodes += [float(r) for r in infos["episode"]["r"][infos["_episode"]]]
                for key, count in (("_boltzlabs_straggler", "stragglers"), ("_boltzlabs_error", "errors")):
                    faults[count] += int(np.sum(infos.get(key, 0)))
            with torch.no_grad():
                next_value = agent.value(torch.as_tensor(next_obs)).numpy()
            adv = gae(rewards, values, next_value, terms, dones, args.gamma, args.gae_lambda)
            atari_update(agent, optim, obs_buf, actions, logps, adv, adv + values, valid, args)
        wall = time.perf_counter() - t0
        if hasattr(envs, "isolation"):
            faults["isolation"] = sandbox(envs.isolation)
    finally:
        envs.close()
    last = episodes[-args.last_n :]
    steps = updates * T * n
    return dict(
        workload="atari",
        kind=kind,
        build_s=build_s,
        wall_s=wall,
        steps=steps,
        sps=steps / wall,
        episodes=len(episodes),
        ret_last=float(np.mean(last)) if last else float("nan"),
        # the first episodes of the run: beside ret_last, whether the return moved during it
        ret_first=float(np.mean(episodes[: args.last_n])) if episodes else float("nan"),
        masked_steps=int((~valid).sum()),  # of the last rollout
        **(faults if "isolation" in faults else {}),
    )


def atari_update(agent, optim, obs_buf, actions, logps, adv, returns, valid, args) -> None:
    """Clipped PPO epochs over the rollout's valid transitions (reset steps left out)."""
    keep = np.flatnonzero(valid.reshape(-1))
    b_obs = torch.as_tensor(obs_buf.reshape(-1, *obs_buf.shape[2:])[keep])
    b_act = torch.as_tensor(actions.reshape(-1)[keep]).long()
    b_logp, b_adv, b_ret = (torch.as_tensor(x.reshape(-1)[keep]) for x in (logps, adv, returns))
    b_val = b_ret - b_adv
    for _ in range(args.atari_epochs):
        for mb in np.array_split(np.random.permutation(len(keep)), args.atari_minibatches):
            if len(mb) == 0:
                continue
            _, logp, entropy, value = agent.act(b_obs[mb], b_act[mb])
            ratio = (logp - b_logp[mb]).exp()
            a = b_adv[mb]
            a = (a - a.mean()) / (a.std(unbiased=False) + 1e-8)
            pg_loss = torch.max(-a * ratio, -a * ratio.clamp(1 - args.clip, 1 + args.clip)).mean()
            v_clipped = b_val[mb] + (value - b_val[mb]).clamp(-args.clip, args.clip)
            v_loss = 0.5 * torch.max((value - b_ret[mb]) ** 2, (v_clipped - b_ret[mb]) ** 2).mean()
            loss = pg_loss - args.ent_coef * entropy.mean() + args.vf_coef * v_loss
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optim.step()


# --------------------------------------------------------------------------- record
def machine_info() -> dict:
    versions = machine.package_versions(
        ("boltzlabs_gym", "gymnasium", "stable-baselines3", "torch", "numpy", "ale-py", "mujoco")
    )
    try:
        git = ["git", "-C", ROOT]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        commit += " (uncommitted changes)" if dirty else ""
    except OSError:
        commit = None
    return dict(
        cpu_count=os.cpu_count(),
        cpu_model=machine.cpu_model(),
        mem_gib=machine.mem_total_gib(),
        python=platform.python_version(),
        versions=versions,
        git_commit=commit,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# Training, not just stepping (`benchmarks/training.py`)\n",
        f"- command: `{record['command']}`",
        f"- date: {m['date']}, git {m['git_commit']}, elapsed {record['elapsed_s']:.0f} s",
        f"- machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {m['mem_gib']} GiB, Python {m['python']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
        f"- load average (1 min) at start {record['loadavg_start']:.1f}, at end {record['loadavg_end']:.1f}",
        f"- config: `{json.dumps(record['config'])}`\n",
    ]
    for wl, title in (("sb3", "SB3 PPO"), ("atari", "CleanRL-style PPO")):
        rows = [r for r in record["rows"] if r["workload"] == wl]
        if not rows:
            continue
        ref = record["random"].get(wl)
        env = record["config"]["mujoco_env" if wl == "sb3" else "atari_env"]
        lines.append(f"## {title}, {env}\n")
        if ref is not None:
            lines.append(f"Random policy: mean return {np.mean(ref):.1f} over {len(ref)} episodes.\n")
        lines.append(markdown_table(rows, wl))
        lines.append(f"Every vectorizer ended at the same returns (same seed, same learning): {same_returns(rows)}\n")
    return "\n".join(lines) + "\n"


def same_returns(rows: list[dict]) -> str:
    """``yes`` when every run that finished reached the same returns, else ``no`` (with the distinct values)."""
    keys = {(r["ret_last"], r.get("eval_ret")) for r in rows if r["status"] == "ok"}
    return "yes" if len(keys) == 1 else f"no ({len(keys)} distinct)"


def markdown_table(rows: list[dict], wl: str) -> str:
    sb3 = wl == "sb3"
    head = "| vectorizer | rep | build s | wall s | env-steps/s | episodes | mean return (last) |"
    head += " eval return |" if sb3 else " mean return (first) |"
    out = [head + " sandbox (failed steps) |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['kind']} | {r['rep'] + 1} | failed: {r['error'].strip().splitlines()[-1]} |")
            continue
        cells = [r["kind"], str(r["rep"] + 1), f"{r['build_s']:.2f}", f"{r['wall_s']:.1f}", f"{r['sps']:.0f}"]
        cells += [str(r["episodes"]), f"{r['ret_last']:.1f}", f"{r['eval_ret' if sb3 else 'ret_first']:.1f}"]
        cells.append(f"{r['isolation']} ({r['stragglers'] + r['errors']})" if "isolation" in r else "-")
        out.append("| " + " | ".join(cells) + " |")
    if sb3:
        out.append("\nepisodes: those in SB3's `ep_info_buffer` (the last 100 at most).")
    else:
        out.append("\nmean return (first): of the run's first episodes, as many as (last) averages.")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--smoke", action="store_true", help="tiny budgets for CI: every vectorizer, both workloads")
    p.add_argument("--workloads", default="sb3,atari", help="comma-separated: sb3, atari")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="runs of every vectorizer; the order rotates each time")
    p.add_argument("--isolation", default="auto", help="ours: the sandbox backend (auto, namespaces, bwrap, process)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--last-n", type=int, default=20, help="episodes the mean return is taken over")
    p.add_argument("--random-episodes", type=int, default=10, help="episodes of the random-policy reference")
    p.add_argument("--out", help="directory of the JSON and markdown record (default benchmarks/results/)")
    g = p.add_argument_group("sb3 (MuJoCo)")
    g.add_argument("--mujoco-env", default="InvertedPendulum-v5")
    g.add_argument("--sb3-timesteps", type=int, default=50_000)
    g.add_argument("--sb3-n-envs", type=int, default=8)
    g.add_argument("--sb3-update", type=int, default=2048, help="samples per PPO update (n_steps x n_envs)")
    g.add_argument("--sb3-kinds", default="dummy,subproc,boltzlabs,boltzlabs_boltz-k4")
    g.add_argument("--eval-episodes", type=int, default=5)
    g = p.add_argument_group("atari (CleanRL-style PPO)")
    g.add_argument("--atari-env", default="ALE/Breakout-v5")
    g.add_argument("--atari-timesteps", type=int, default=100_000)
    g.add_argument("--atari-n-envs", type=int, default=8)
    g.add_argument("--atari-n-steps", type=int, default=128, help="rollout length per env")
    g.add_argument("--atari-kinds", default="sync,async,boltzlabs,boltzlabs_boltz-k4")
    g.add_argument("--atari-lr", type=float, default=2.5e-4)
    g.add_argument("--atari-epochs", type=int, default=4)
    g.add_argument("--atari-minibatches", type=int, default=4)
    g.add_argument("--gamma", type=float, default=0.99)
    g.add_argument("--gae-lambda", type=float, default=0.95)
    g.add_argument("--clip", type=float, default=0.1)
    g.add_argument("--ent-coef", type=float, default=0.01)
    g.add_argument("--vf-coef", type=float, default=0.5)
    g.add_argument("--max-grad-norm", type=float, default=0.5)
    args = p.parse_args(argv)
    if args.smoke:  # the smoke budgets, unless a flag was given explicitly
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])}
        for key, value in SMOKE.items():
            if key not in given:
                setattr(args, key, value)
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="training-smoke-") if args.smoke else os.path.join(HERE, "results")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - {"sb3", "atari"}
    if unknown:
        raise SystemExit(f"unknown workloads: {sorted(unknown)} (known: sb3, atari)")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    machine = machine_info()
    start = time.time()
    load0 = os.getloadavg()[0]
    print(f"training.py: {json.dumps(config)}", flush=True)
    print(
        f"machine: {machine['cpu_count']} CPUs, {machine['cpu_model']}, git {machine['git_commit']}, "
        f"load average {load0:.1f}",
        flush=True,
    )
    if "sb3" in workloads:
        print(f"sb3: PPO {sb3_hyperparameters(args)} on {args.mujoco_env}, {args.sb3_n_envs} envs", flush=True)
    if "atari" in workloads:
        print(
            f"atari: {args.atari_env}, {args.atari_n_envs} envs x {args.atari_n_steps} steps per update, "
            f"{max(1, args.atari_timesteps // (args.atari_n_envs * args.atari_n_steps))} updates",
            flush=True,
        )

    reference: dict[str, list[float]] = {}
    if "sb3" in workloads:
        reference["sb3"] = random_returns(lambda: gym.make(args.mujoco_env), args.random_episodes, args.seed)
    if "atari" in workloads:
        make = functools.partial(training_envs.make_atari, args.atari_env)
        reference["atari"] = random_returns(make, args.random_episodes, args.seed)
    for wl, ref in reference.items():
        print(f"RANDOM workload={wl} mean_return={np.mean(ref):.2f} episodes={len(ref)}", flush=True)

    rows = []
    for wl in workloads:
        kinds = [k for k in (args.sb3_kinds if wl == "sb3" else args.atari_kinds).split(",") if k]
        runner = sb3_run if wl == "sb3" else atari_run
        for rep in range(args.repeats):
            for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
                try:
                    row = dict(runner(kind, args), status="ok", rep=rep)
                    print(
                        f"RESULT workload={wl} kind={kind} rep={rep + 1} wall_s={row['wall_s']:.2f} "
                        f"sps={row['sps']:.0f} episodes={row['episodes']} ret_last={row['ret_last']:.2f}"
                        + (f" eval_ret={row['eval_ret']:.2f}" if wl == "sb3" else f" ret_first={row['ret_first']:.2f}")
                        + "".join(f" {k}={row[k]}" for k in ("isolation", "stragglers", "errors") if k in row),
                        flush=True,
                    )
                except Exception:
                    row = dict(workload=wl, kind=kind, rep=rep, status="error", error=traceback.format_exc())
                    print(
                        f"FAILED workload={wl} kind={kind} rep={rep + 1}\n{row['error']}", file=sys.stderr, flush=True
                    )
                rows.append(row)
        print(f"SAME_RETURNS workload={wl} {same_returns([r for r in rows if r['workload'] == wl])}", flush=True)

    record = dict(
        command="python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        config=config,
        machine=machine,
        loadavg_start=load0,
        loadavg_end=os.getloadavg()[0],
        elapsed_s=time.time() - start,
        random=reference,
        rows=rows,
    )
    text = markdown(record)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"training-{machine['date'][:10]}" + ("-smoke" if args.smoke else ""))
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(f"wrote {stem}.json and {stem}.md")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
