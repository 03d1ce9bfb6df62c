"""The worker's part of shared observations: take an env's region out of it, seal it, pass it on.

A local pool asks an env process for an observation region with an ``obs_region`` item
(:mod:`boltzlabs_gym.client.obs_regions`). The env makes a memfd and answers with its descriptor
number and size (:mod:`boltzlabs_gym.envside.obs_region`). That answer is untrusted, so the worker
does not pass it on as it is: it takes the descriptor out of the env process itself
(``pidfd_getfd``), checks that it is a memfd of the stated size, adds the seals that stop anyone
shrinking or growing it (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``; a shrunk memfd would raise
SIGBUS in the pool that maps it), checks that they are in force, and sends the descriptor to the
pool with the batch reply, after telling the env to use it (only then does the env write into
it and refer to it: a region refused here is never used). Anything that fails (no
``pidfd_getfd`` under this kernel or its ptrace rules, a lie about the descriptor or its size)
answers that env's item with an error, and the env keeps sending observations as bytes.

The env makes the memfd and the worker seals it, rather than the worker making it: the guarantees
are the same (only the seals protect the pool, and only the worker sets them), and no spawn path
(five of them, with their sandboxes) has to carry one more descriptor into the env.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import stat
from collections.abc import Callable

from ..wire.protocol import OK, parse_json

log = logging.getLogger(__name__)

__all__ = ["RegionCatcher", "take_region", "REQUIRED_SEALS", "MAX_REGION_BYTES", "USE_REGION"]

#: Seals a region must have before it goes to the pool.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
#: The largest region passed on (a sandbox's observations of one step).
MAX_REGION_BYTES = 1 << 30
_SYS_PIDFD_GETFD = 438
_MEMFD_LINK = "/memfd:boltzlabs-obs"
_libc = ctypes.CDLL(None, use_errno=True)


class RegionRefused(Exception):
    """Why an env's region cannot be passed on (said in its item's result)."""


def _pidfd_getfd(pid: int, fd: int) -> int:
    """A duplicate, in this process, of descriptor ``fd`` of process ``pid``."""
    pidfd = os.pidfd_open(pid)
    try:
        got = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
        return got
    finally:
        os.close(pidfd)


def _described(reply: bytes, count: int) -> dict:
    """The env's description of its region, checked: a descriptor number, a size that holds
    ``count`` slots of its slot size, within :data:`MAX_REGION_BYTES`."""
    try:
        answer = parse_json(reply)
    except ValueError:
        raise RegionRefused("its answer is not JSON") from None
    region = answer.get("obs_region") if isinstance(answer, dict) else None
    if not isinstance(region, dict):
        why = answer.get("error") if isinstance(answer, dict) else None
        raise RegionRefused(str(why)[:300] if why else "its answer describes no region")
    values = [region.get(k) for k in ("fd", "bytes", "slots", "slot_bytes")]
    if not all(type(v) is int for v in values):
        raise RegionRefused("fd, bytes, slots and slot_bytes must be integers")
    fd, size, slots, slot_bytes = (int(v) for v in values)  # type: ignore[arg-type]  # ints, checked
    if fd < 0 or slots != count or slot_bytes < 1 or not slots * slot_bytes <= size <= MAX_REGION_BYTES:
        raise RegionRefused(f"a region of {size} bytes for {slots} slots of {slot_bytes} (it hosts {count} envs)")
    if "layout" in region:  # a Dict/Tuple observation's arrays, back to back
        # (imported here: it parses dtypes with NumPy, which a worker loads only for such envs)
        from ..wire.slot_layout import layout_spans, skeleton_fits

        spans = layout_spans(region["layout"])
        if spans is None or slot_bytes != sum(size for _, size in spans):
            raise RegionRefused(f"its layout {str(region['layout'])[:120]} is not {slot_bytes} bytes of arrays")
        skeleton = region.get("skeleton")
        if skeleton is not None and not skeleton_fits(skeleton, region["layout"]):
            raise RegionRefused(f"its skeleton {str(skeleton)[:120]} does not refer to its layout's arrays")
    elif not isinstance(region.get("dtype"), str) or not isinstance(region.get("shape"), list):
        raise RegionRefused("what a slot holds is missing: dtype and shape, or a layout")
    return region


def _seal(fd: int, size: int) -> None:
    """Check ``fd`` is the env's memfd of ``size`` bytes and seal it against any change of size."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not os.readlink(f"/proc/self/fd/{fd}").startswith(_MEMFD_LINK):
        raise RegionRefused("its descriptor is not its observation memfd")
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
    except OSError as exc:  # sealed already (by the env: fine if what we need is in force), or not sealable
        log.debug("adding seals to an env's region: %s", exc)
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise RegionRefused("its memfd cannot be sealed against shrinking")
    if os.fstat(fd).st_size != size:  # checked after sealing: it cannot change any more
        raise RegionRefused(f"its memfd has {os.fstat(fd).st_size} bytes, not the {size} it said")


def take_region(pid: int | None, count: int, reply: bytes) -> tuple[bytes, int | None]:
    """The reply to pass on for an env's answer to ``obs_region``, and the sealed descriptor (or
    ``None`` with an error reply). ``pid``: the env process; ``count``: the envs it hosts."""
    fd = -1
    try:
        region = _described(reply, count)
        if not pid:
            raise RegionRefused("the env has no process")
        fd = _pidfd_getfd(pid, region["fd"])
        _seal(fd, region["bytes"])
    except (RegionRefused, OSError) as exc:
        if fd >= 0:
            os.close(fd)
        log.debug("no observation region for env process %s: %s", pid, exc)
        return json.dumps({"error": f"no shared observation region: {exc}"}).encode(), None
    kept = ("bytes", "slots", "slot_bytes", "dtype", "shape", "layout", "skeleton")
    described = {k: region[k] for k in kept if k in region}
    return json.dumps({"obs_region": described}).encode(), fd


#: The request that tells an env to use its region (sent once it is sealed).
USE_REGION = {"op": "obs_region", "use": True}


class RegionCatcher:
    """Stands in for a batch as an ``obs_region`` call's destination. On the env's answer it takes
    the region out of the env and seals it (:func:`take_region`), then tells the env to use it
    (``submit(op, destination)`` queues that request to the same env); once the env says it does,
    the batch gets the region's description, its descriptor kept on the batch to travel with the
    reply. Anything that fails on the way is the item's result, and the env never uses the region."""

    __slots__ = ("batch", "env", "submit", "_sealed")

    def __init__(self, batch, env, submit: Callable[[dict, object], None]):
        self.batch, self.env, self.submit = batch, env, submit
        self._sealed: tuple[bytes, int] | None = None

    def done(self, pos: int, index: int, status: str, reply: bytes, payloads: list) -> None:
        sealed, self._sealed = self._sealed, None
        if sealed is not None:  # the env's answer to USE_REGION
            self._finish(pos, index, status, reply, sealed)
            return
        if status != OK:
            self.batch.done(pos, index, status, reply, payloads)
            return
        described, fd = take_region(self.env.pid, self.env.count, reply)  # the process that answered
        if fd is None:
            self.batch.done(pos, index, OK, described, [])
            return
        self._sealed = (described, fd)
        self.submit(USE_REGION, self)

    def _finish(self, pos: int, index: int, status: str, reply: bytes, sealed: tuple[bytes, int]) -> None:
        described, fd = sealed
        try:
            answer = parse_json(reply) if status == OK else None
        except ValueError:
            answer = None
        if not (isinstance(answer, dict) and answer.get("obs_region") == {"in_use": True}):
            os.close(fd)
            if status == OK:
                reply = json.dumps({"error": f"no shared observation region: the env said {reply[:200]!r}"}).encode()
            self.batch.done(pos, index, status, reply, [])
            return
        self.env.obs_region_inode = os.fstat(fd).st_ino
        fds = self.batch.region_fds
        region = json.loads(described)
        region["obs_region"]["fd_index"] = len(fds)
        fds.append(fd)
        self.batch.done(pos, index, OK, json.dumps(region).encode(), [])
