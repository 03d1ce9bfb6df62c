"""The env side of snapshots: an env's state as bytes, taken and put back inside its sandbox.

Standard library only, like :mod:`boltzlabs_gym.envside`: it runs in every sandbox.

A *portable* snapshot is a blob the env process writes about itself and only ever reads back
inside a sandbox: the worker and the trainer hold it, move it and save it, but never unpickle
it (see "Snapshots" in :mod:`boltzlabs_gym.wire.protocol`). It holds

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
from collections.abc import Sequence
from typing import Any

#: The first bytes of every blob: a format tag the env side checks before it unpickles.
BLOB_MAGIC = b"BLZSTATE1\n"
#: The snapshot kind these blobs are (reported on the trainer's Snapshot).
PORTABLE, MEMORY, AUTO = "portable", "memory", "auto"  # as in boltzlabs_gym.wire.protocol
#: The largest blob: one env reply's payload limit (protocol.MAX_ENV_PAYLOAD_BYTES, 256 MiB; a test
#: ties the two), less room for the request line a restore sends it with.
MAX_BLOB_BYTES = (256 << 20) - (64 << 10)
#: The directory a restore unpacks the workspace into first (inside the workspace, so the final
#: moves are renames on one file system); nothing of the old workspace is touched until it is whole.
STAGING_DIR = ".boltzlabs-restoring"


#: Why an env that no reset or restore started since its process started cannot be snapshotted.
NOT_STARTED = (
    "cannot snapshot: the env has not been reset since its process was (re)started (a straggler, a crash, "
    "a hard reset or an idle death took its last episode's state with it); reset it before a snapshot"
)


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
        blob = BLOB_MAGIC + _pickler().dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the same refusal
        what = "what its get_state() returned" if hooked else f"the env object ({type(env).__name__})"
        raise SnapshotRefused(
            f"cannot snapshot: {what} does not pickle ({type(exc).__name__}: {exc}); give the env "
            "get_state() and set_state(state) methods that return and take picklable state"
        ) from None
    if len(blob) > MAX_BLOB_BYTES:
        raise SnapshotRefused(
            f"cannot snapshot: the state is {len(blob) >> 20} MiB (env, generators and workspace files), over "
            f"the {MAX_BLOB_BYTES >> 20} MiB one snapshot may hold; keep large files out of the workspace, or "
            "give the env get_state()/set_state() that return only what it needs to go on"
        )
    return blob


def snapshot_reply(
    env: Any,
    last_obs: Any,
    started: bool,
    workspace: str | None,
    kind: Any = None,
    nonce: Any = None,
    maker: Any = None,
) -> tuple[dict, list] | None:
    """The answer to a ``snapshot`` request: the blob as its one payload, or an error reply. A
    snapshot never ends the env: a refusal, or an error in its ``get_state()``, is answered.

    ``kind`` ``"memory"`` or ``"auto"`` (the worker asks for it where the env can fork: boltz
    mode, namespaces backend): the process swaps roles with a held fork of itself (see
    :mod:`boltzlabs_gym.envside.memory_snapshot`) and answers ``{"snapshot": {"kind": "memory"}}``; in a
    copy forked later from the holder, this returns ``None``: nothing to answer, the copy waits
    for its restore request. ``"auto"`` falls back to the portable blob where the env cannot fork.
    ``nonce``: the request's ``swap`` key, which names the worker's message with the new socket;
    ``maker``: this process's memory-snapshot maker (:func:`boltzlabs_gym.envside.process_setup.memory_snapshots`).
    """
    if not started:
        return {"error": NOT_STARTED}, []
    if kind in (MEMORY, AUTO):
        why = "this env process cannot fork copies (not a boltz-mode env of the namespaces backend)"
        if maker is not None:
            try:
                role = maker.snapshot(nonce if isinstance(nonce, str) else "")
            except Exception as exc:  # noqa: BLE001 - MemorySnapshotRefused: nothing changed
                why = str(exc)
            else:
                return None if role == "copy" else ({"snapshot": {"kind": MEMORY}}, [])
        if kind == MEMORY:
            return {"error": f"cannot take a memory snapshot: {why}"}, []
        reply = _portable_reply(env, last_obs, workspace)
        if "error" in reply[0]:  # neither kind: say why not for both
            reply[0]["error"] += f" (and a memory snapshot: {why})"
        return reply
    return _portable_reply(env, last_obs, workspace)


def _portable_reply(env: Any, last_obs: Any, workspace: str | None) -> tuple[dict, list]:
    try:
        blob = capture(env, last_obs, workspace)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the env serves on
        message = str(exc) if isinstance(exc, SnapshotRefused) else f"{type(exc).__name__}: {exc}"
        return {"error": message if message.startswith("cannot") else f"cannot snapshot: {message}"}, []
    return {"snapshot": {"kind": PORTABLE, "bytes": len(blob)}}, [blob]


def restore_request(
    env: Any, msg: dict, payloads: Sequence, workspace: str | None, last_obs: Any = None, maker: Any = None
) -> tuple[Any, dict]:
    """Serve a ``restore`` request: the env to serve from now on, and the state it was given (its
    ``"obs"`` is the answer's observation). :class:`SnapshotRefused`, with the message to answer,
    when it cannot be done: the env is then as it was (see :func:`apply`).

    A memory snapshot's restore (``"kind": "memory"``) reaches a process that already is the copy
    (forked from the holder): it only reseeds when asked and answers with ``last_obs``."""
    seed = msg.get("reseed")
    if seed is not None and (type(seed) is not int or seed < 0):
        raise SnapshotRefused(f"reseed must be a non-negative int or null, got {seed!r}")
    if msg.get("kind") == MEMORY:
        if maker is None or not maker.take_copy() or payloads:
            raise SnapshotRefused("a memory snapshot's restore reached a process that is not a fresh copy of it")
        if seed is not None:
            try:
                reseed(env, seed)
            except Exception as exc:  # noqa: BLE001
                raise SnapshotRefused(f"restore failed: reseed: {type(exc).__name__}: {exc}") from None
        return env, {"obs": last_obs}
    if len(payloads) != 1:
        raise SnapshotRefused("restore needs exactly one payload: the snapshot blob")
    try:
        state = load(payloads[0])
        env = apply(state, env, workspace)
        if seed is not None:
            reseed(env, seed)
    except Exception as exc:  # noqa: BLE001 - a refusal, or the state's own unpickling error: the env serves on
        raise SnapshotRefused(f"restore failed: {type(exc).__name__}: {exc}") from None
    return env, state


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
    """Put ``state`` into this process: the env, its workspace and the generators; the env to serve from now on.

    With a ``set_state`` hook the current ``env`` object is kept and given the state; otherwise
    the unpickled env object replaces it. All or nothing, as far as this module can make it so:
    the workspace is unpacked aside first, and nothing changes until it is whole and the env took
    its state (what a ``set_state`` that raises did to its env is the hook's own business).
    """
    hooked = bool(state.get("hooked"))
    set_state = getattr(env, "set_state", None)
    if hooked and not callable(set_state):
        raise SnapshotRefused("the snapshot was taken with get_state(), but this env has no set_state(state)")
    staged = stage_workspace(workspace, state.get("workspace")) if workspace else None
    try:
        if hooked:
            set_state(state["env"])  # type: ignore[misc]  # callable checked above
        else:
            env = state["env"]
    except BaseException:
        if staged is not None:
            _remove(staged[0])
        raise
    if workspace and staged is not None:
        swap_in_workspace(workspace, staged)
    random.setstate(state["random"])
    np = sys.modules.get("numpy")
    if state.get("numpy") is not None and np is not None:
        np.random.set_state(state["numpy"])
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
                if info.islnk():
                    # A second name of a file already packed: packed again as a file of its own (a copy
                    # restores it as two files; hard links cannot be made safely by the unpacker).
                    info.type, info.linkname, info.size = tarfile.REGTYPE, "", st.st_size
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _raise(exc: OSError) -> None:
    """``os.walk``'s ``onerror``: an unreadable directory stops the snapshot, not silently shrinks it."""
    raise exc


def _remove(path: str) -> None:
    """Remove ``path`` and all under it, whatever the modes its owner gave it (a 0o500 directory
    included); errors raise: a workspace that cannot be emptied is not replaced."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        os.chmod(path, 0o700)
        for name in os.listdir(path):
            _remove(os.path.join(path, name))
        os.rmdir(path)
    else:
        os.unlink(path)


def unpack_workspace(path: str, data: bytes | None) -> None:
    """Make ``path`` hold exactly the files of ``data`` (a tar from :func:`pack_workspace`)."""
    swap_in_workspace(path, stage_workspace(path, data))


def stage_workspace(path: str, data: bytes | None) -> tuple[str, list[tuple[str, int]]]:
    """Unpack ``data`` into a staging directory in ``path`` (removed again if anything fails): its path,
    and the modes its directories get once moved in place (until then they stay writable: moving a
    directory to another parent needs write access to it).

    Extracted member by member, refusing what could write outside: absolute names, ``..``, a
    member under a symbolic link, hard links and device files.
    """
    staging = os.path.join(path, STAGING_DIR)
    if os.path.lexists(staging):
        _remove(staging)
    os.mkdir(staging, 0o700)
    try:
        return staging, _extract(staging, data)
    except BaseException:
        _remove(staging)
        raise


def swap_in_workspace(path: str, staged: tuple[str, list[tuple[str, int]]]) -> None:
    """Replace everything in ``path`` but the staging directory by what it holds."""
    staging, dir_modes = staged
    keep = os.path.basename(staging)
    for name in os.listdir(path):
        if name != keep:
            _remove(os.path.join(path, name))
    for name in os.listdir(staging):
        os.rename(os.path.join(staging, name), os.path.join(path, name))
    os.rmdir(staging)
    for relative, mode in reversed(dir_modes):  # deepest first
        os.chmod(os.path.join(path, relative), mode)


def _extract(path: str, data: bytes | None) -> list[tuple[str, int]]:
    """Unpack ``data`` under ``path``; the directories' relative paths and the modes they are due."""
    dir_modes: list[tuple[str, int]] = []  # set once in place (a 0o500 directory takes no file, moves nowhere)
    if not data:
        return dir_modes
    links: set[str] = set()
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
                dir_modes.append((name, member.mode & 0o7777))
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
    return dir_modes
