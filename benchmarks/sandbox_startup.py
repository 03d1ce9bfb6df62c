"""Per-env launch cost of each isolation backend.

For each backend: the median (and p90) over N launches of
  * ``launch``: time ``backend.launch()`` takes to return (for namespaces and bwrap this waits until
    the child has exec'd python or bwrap, so it includes the whole sandbox setup),
  * ``python -c pass``: from the start of launch until the env process has exited (reaped).
"bare" is a plain ``fork`` + ``execve`` with nothing else.

    python benchmarks/sandbox_startup.py [-n 30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import boltzlabs
import boltzlabs_gym
from boltzlabs_gym.worker.sandbox import LaunchSpec, Limits
from boltzlabs_gym.worker.sandbox.base import wipe_workspace
from boltzlabs_gym.worker.sandbox.bwrap import BwrapBackend
from boltzlabs_gym.worker.sandbox.namespaces import NamespaceBackend
from boltzlabs_gym.worker.sandbox.process import ProcessBackend

RUNTIME = {
    "boltzlabs_gym": os.path.dirname(os.path.abspath(boltzlabs_gym.__file__)),
    "boltzlabs": os.path.dirname(os.path.abspath(boltzlabs.__file__)),
}
ARGV = [sys.executable, "-c", "pass"]


def bare_once() -> tuple[float, float]:
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(ARGV[0], ARGV)
        finally:
            os._exit(127)
    t1 = time.perf_counter()
    os.waitpid(pid, 0)
    return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3


def backend_once(backend, env_dir: str, ws: str, index: int) -> tuple[float, float]:
    null = os.open(os.devnull, os.O_RDWR)
    try:
        spec = LaunchSpec(argv=ARGV, env_dir=env_dir, workspace=ws, stdin_fd=null, stdout_fd=null, stderr_fd=null,
                          limits=Limits(), index=index, runtime=RUNTIME)
        t0 = time.perf_counter()
        launched = backend.launch(spec)
        t1 = time.perf_counter()
    finally:
        os.close(null)
    _, status = os.waitpid(launched.pid, 0)
    t2 = time.perf_counter()
    launched.kill_tree()
    launched.cleanup()
    if status != 0 or launched.setup_error:
        raise RuntimeError(f"{backend.name}: env failed ({status}): {launched.setup_error}")
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3


def summarize(samples: list[float]) -> str:
    samples = sorted(samples)
    p90 = samples[min(len(samples) - 1, int(0.9 * len(samples)))]
    return f"{statistics.median(samples):7.1f} ({p90:6.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=30, help="launches per backend (default 30)")
    args = ap.parse_args()
    top = tempfile.mkdtemp(prefix="sbxbench-")
    os.chmod(top, 0o755)
    env_dir = os.path.join(top, "env")
    ws = os.path.join(top, "ws")
    os.mkdir(env_dir, 0o755)
    os.mkdir(ws, 0o700)
    rows = []
    try:
        for _ in range(3):
            bare_once()
        b = [bare_once() for _ in range(args.n)]
        rows.append(("bare fork+exec", "-", [x[0] for x in b], [x[1] for x in b]))
        for backend in (ProcessBackend(), NamespaceBackend(), BwrapBackend()):
            ok, why = backend.available()
            if not ok:
                rows.append((backend.name, f"unavailable: {why[:60]}", None, None))
                continue
            mode = str(backend.report().properties.get("mode", "-"))
            for i in range(3):
                backend_once(backend, env_dir, ws, i)
                wipe_workspace(ws)
            s = []
            for i in range(args.n):
                s.append(backend_once(backend, env_dir, ws, i))
                wipe_workspace(ws)
            rows.append((backend.name, mode, [x[0] for x in s], [x[1] for x in s]))
    finally:
        shutil.rmtree(top, ignore_errors=True)
    print(f"uid={os.geteuid()} n={args.n} python={sys.executable}  median (p90) in ms")
    print(f"{'backend':<16} {'mode':<8} {'launch()':>16} {'python -c pass':>18}")
    for name, mode, launch, full in rows:
        if launch is None:
            print(f"{name:<16} {mode}")
            continue
        print(f"{name:<16} {mode:<8} {summarize(launch):>16} {summarize(full):>18}")
    bare = statistics.median(rows[0][3])
    for name, _, launch, full in rows[1:]:
        if full is not None:
            print(f"  {name}: +{statistics.median(full) - bare:.1f} ms over bare for a full python -c pass")


if __name__ == "__main__":
    main()
