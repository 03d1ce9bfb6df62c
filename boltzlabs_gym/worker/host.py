"""The worker process's plumbing on its host: reaping, dead workers' leftovers, file trees."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile

from .sandbox.cgroups import pid_alive

log = logging.getLogger("boltzlabs_gym.worker")


#: A dead worker's directory is renamed to ``<name>.swept-by-<pid>`` by the worker removing it, so
#: that workers starting together (a pool replacing several lost workers at once) never remove the
#: same tree at the same time: one rename wins, the others find nothing there.
_CLAIM = ".swept-by-"


def sweep_stale_workers(workdir: str | None) -> None:
    """Remove what workers that died without cleaning up (SIGKILL) left behind.

    Their env processes died with them (pid-namespace inits are killed with their
    parent); their temp dirs and cgroups stay unless the next worker sweeps them.
    Best effort: a sweep never stops this worker from starting.
    """
    import glob

    for path in glob.glob(os.path.join(workdir or tempfile.gettempdir(), "boltzlabs-worker-*")):
        if not _abandoned(path):
            continue
        name = os.path.basename(path)
        claimed = os.path.join(os.path.dirname(path), name.split(_CLAIM)[0] + f"{_CLAIM}{os.getpid()}")
        try:
            os.rename(path, claimed)
        except OSError:
            continue  # another starting worker claimed it first
        log.info("removing %s, left by a dead worker", path)
        try:
            wipe_tree(claimed)
            os.rmdir(claimed)
        except OSError as e:
            log.warning("could not remove %s, left by a dead worker: %s", claimed, e)
    try:
        from .sandbox.cgroups import sweep_stale

        sweep_stale()
    except Exception:  # noqa: BLE001 - best effort: no cgroups here, or not ours to remove
        log.debug("cgroup sweep failed", exc_info=True)


def _abandoned(path: str) -> bool:
    """Whether the worker directory ``path`` belongs to no live process: its worker is dead and
    no live worker is removing it. A directory without a readable pid file is not ours to judge."""
    _, _, claimant = os.path.basename(path).partition(_CLAIM)
    if claimant.isdigit():  # a sweep began; its pid file may be gone already
        return not pid_alive(int(claimant))
    try:
        with open(os.path.join(path, "owner.pid")) as f:
            owner = int(f.read().strip())
    except (OSError, ValueError):
        return False  # no pid file yet (a worker starting), or another user's
    return not pid_alive(owner)


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
