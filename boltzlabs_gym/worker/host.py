"""The worker process's plumbing on its host: reaping, dead workers' leftovers, file trees."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile

log = logging.getLogger("boltzlabs_gym.worker")


def sweep_stale_workers(workdir: str | None) -> None:
    """Remove what workers that died without cleaning up (SIGKILL) left behind.

    Their env processes died with them (pid-namespace inits are killed with their
    parent); their temp dirs and cgroups stay unless the next worker sweeps them.
    """
    import glob

    for path in glob.glob(os.path.join(workdir or tempfile.gettempdir(), "boltzlabs-worker-*")):
        try:
            with open(os.path.join(path, "owner.pid")) as f:
                owner = int(f.read().strip())
            os.kill(owner, 0)
            continue  # its worker is alive
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue  # not ours to judge (no pid file yet, or another user's)
        log.info("removing %s, left by dead worker %s", path, owner)
        wipe_tree(path)
        shutil.rmtree(path, ignore_errors=True)
    try:
        from .sandbox.cgroups import sweep_stale

        sweep_stale()
    except Exception:  # noqa: BLE001 - best effort: no cgroups here, or not ours to remove
        log.debug("cgroup sweep failed", exc_info=True)


def drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


def make_tree_readable(path: str) -> None:
    """Unpacked archives are shared read-only by every env (which may run as another uid)."""
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, os.stat(full).st_mode | 0o444)
    os.chmod(path, 0o755)


def wipe_tree(path: str) -> None:
    """Empty ``path``, whatever permissions its contents were given."""

    def fix(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass
        func(p)

    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)
        return
    os.chmod(path, 0o700)
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            os.chmod(full, 0o700)
            shutil.rmtree(full, onerror=fix)
        else:
            os.unlink(full)


def set_subreaper() -> None:
    """Adopt orphaned env processes so none is left unreaped (Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:  # noqa: BLE001 - best effort
        pass


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass
