"""The env side of snapshots: an env's state as bytes, taken and put back inside its sandbox.

Standard library only, like :mod:`boltzlabs_gym.envside`: it runs in every sandbox.

A *portable* snapshot is a blob the env process writes about itself and only ever reads back
inside a sandbox: the worker and the trainer hold it, move it and save it, but never unpickle
it (see "Snapshots" in :mod:`boltzlabs_gym.protocol`). It holds

* the env's state: the env object itself (pickled; cloudpickle where the sandbox has it, so
  classes the trainer shipped by value pickle too), or what the env's ``get_state()`` hook
  returns, which its ``set_state(state)`` hook is given back;
* the observation the env last returned, which a restore answers with, as a reset does;
* Python's ``random`` state and NumPy's global generator state (when NumPy is loaded);
* the files under ``/workspace`` (a tar of regular files, directories and symbolic links).

Restoring replaces the env, the generators and the workspace's files of a live env process;
what else the process holds (module globals the env does not reach, files under ``/tmp``)
stays that process's own. A ``reseed`` then gives the copy streams of its own: ``random``,
NumPy's global generator and, for an env with a Gymnasium ``np_random``, that generator.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import stat
import sys
import tarfile
from typing import Any

#: The first bytes of every blob: a format tag the env side checks before it unpickles.
BLOB_MAGIC = b"BLZSTATE1\n"
#: The snapshot kind these blobs are (reported on the trainer's Snapshot).
PORTABLE = "portable"


class SnapshotRefused(Exception):
    """The env cannot be snapshotted or restored; the message says why and what to do."""


def _pickler():
    """cloudpickle where the process has loaded it (a Gymnasium env's factories came that way, so classes
    the trainer shipped by value pickle too), else the standard library's pickle."""
    return sys.modules.get("cloudpickle") or pickle


def _numpy_state() -> Any:
    np = sys.modules.get("numpy")
    if np is None:
        return None
    try:
        return np.random.get_state()
    except Exception:  # noqa: BLE001 - a numpy without the legacy global generator
        return None


def capture(env: Any, obs: Any, workspace: str | None) -> bytes:
    """The blob of this process's env ``env`` whose last observation was ``obs``.

    Raises :class:`SnapshotRefused` when the state cannot be pickled (with the fix in the message).
    """
    get_state = getattr(env, "get_state", None)
    hooked = callable(get_state)
    state = {
        "hooked": hooked,
        "env": get_state() if hooked else env,  # type: ignore[misc]  # callable checked above
        "obs": obs,
        "random": random.getstate(),
        "numpy": _numpy_state(),
        "workspace": _packed_or_refused(workspace) if workspace else None,
    }
    try:
        return BLOB_MAGIC + _pickler().dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the same refusal
        what = "what its get_state() returned" if hooked else f"the env object ({type(env).__name__})"
        raise SnapshotRefused(
            f"cannot snapshot: {what} does not pickle ({type(exc).__name__}: {exc}); give the env "
            "get_state() and set_state(state) methods that return and take picklable state"
        ) from None


def _packed_or_refused(workspace: str) -> bytes | None:
    try:
        return pack_workspace(workspace)
    except OSError as exc:
        raise SnapshotRefused(
            f"cannot snapshot: the workspace cannot be read whole ({type(exc).__name__}: {exc}); a snapshot "
            "that left it out would not be exact. Keep workspace files readable by the env"
        ) from None


def load(blob: bytes) -> dict:
    """The state in ``blob`` (unpickled here, inside the sandbox that will run it)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)) or bytes(blob[: len(BLOB_MAGIC)]) != BLOB_MAGIC:
        raise SnapshotRefused("restore needs one payload: a snapshot blob of this library's format")
    state = pickle.loads(memoryview(blob)[len(BLOB_MAGIC) :])
    if not isinstance(state, dict) or "env" not in state:
        raise SnapshotRefused("the snapshot blob holds no env state")
    return state


def apply(state: dict, env: Any, workspace: str | None) -> Any:
    """Put ``state`` into this process: its generators and workspace, and the env; the env to serve from now on.

    With a ``set_state`` hook the current ``env`` object is kept and given the state; otherwise
    the unpickled env object replaces it.
    """
    if state.get("hooked"):
        set_state = getattr(env, "set_state", None)
        if not callable(set_state):
            raise SnapshotRefused("the snapshot was taken with get_state(), but this env has no set_state(state)")
        set_state(state["env"])
    else:
        env = state["env"]
    random.setstate(state["random"])
    np = sys.modules.get("numpy")
    if state.get("numpy") is not None and np is not None:
        np.random.set_state(state["numpy"])
    if workspace:
        unpack_workspace(workspace, state.get("workspace"))
    return env


def reseed(env: Any, seed: int) -> None:
    """Give this process's generators (and the env's own, where it has one) streams of ``seed``."""
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
    hook = getattr(env, "reseed", None)
    if callable(hook):
        hook(seed)
        return
    unwrapped = getattr(env, "unwrapped", env)
    if np is not None and hasattr(unwrapped, "_np_random"):
        # What Gymnasium's reset(seed=) does to the env's generator (gymnasium.utils.seeding.np_random),
        # without resetting the env.
        unwrapped._np_random = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))
        unwrapped._np_random_seed = seed


# ---------------------------------------------------------------------------------------- workspace


def pack_workspace(path: str) -> bytes | None:
    """The files under ``path`` as an uncompressed tar (``None`` for an empty directory).

    Regular files, directories and symbolic links (as links, never followed); anything else
    (a FIFO, a socket) is left out: it cannot be copied, and opening a FIFO would block.
    """
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if not names:
        return None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(path, onerror=_raise):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(root, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue
                info = tar.gettarinfo(full, arcname=os.path.relpath(full, path))
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _raise(exc: OSError) -> None:
    """``os.walk``'s ``onerror``: an unreadable directory stops the snapshot, not silently shrinks it."""
    raise exc


def _clear(path: str) -> None:
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            import shutil

            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.unlink(full)
            except OSError:
                pass


def unpack_workspace(path: str, data: bytes | None) -> None:
    """Make ``path`` hold exactly the files of ``data`` (a tar from :func:`pack_workspace`).

    Extracted member by member, refusing what could write outside ``path``: absolute names,
    ``..``, a member under a symbolic link, hard links and device files.
    """
    _clear(path)
    if not data:
        return
    links: set[str] = set()
    dir_modes: list[tuple[str, int]] = []  # set once their contents are in (a 0o500 directory takes no file)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            name = os.path.normpath(member.name)
            parts = name.split(os.sep)
            if os.path.isabs(name) or ".." in parts or name in (".", ""):
                raise SnapshotRefused(f"workspace entry {member.name!r} points outside the workspace")
            if any(os.sep.join(parts[:i]) in links for i in range(1, len(parts))):
                raise SnapshotRefused(f"workspace entry {member.name!r} lies under a symbolic link")
            target = os.path.join(path, name)
            if member.isdir():
                os.makedirs(target, mode=0o700, exist_ok=True)
                dir_modes.append((target, member.mode & 0o7777))
            elif member.isreg():
                src = tar.extractfile(member)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    if src is not None:
                        while chunk := src.read(1 << 20):
                            out.write(chunk)
                    os.fchmod(out.fileno(), member.mode & 0o7777)  # exactly its mode: no umask
                os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)
            elif member.issym():
                os.symlink(member.linkname, target)
                links.add(name)
            else:
                raise SnapshotRefused(f"workspace entry {member.name!r} is not a file, directory or link")
    for target, mode in reversed(dir_modes):  # deepest first
        os.chmod(target, mode)
