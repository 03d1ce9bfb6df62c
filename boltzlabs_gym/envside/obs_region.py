"""The env side of shared observations: this process's observation region (a sealed memfd).

A local pool may ask an env process for an observation region (``{"op": "obs_region"}``, see
``docs/shared-memory.md``). The process then creates one memfd of ``slots`` x ``slot_bytes``
(one slot per env it hosts; a slot holds one observation of the declared space: one array, or a
Dict/Tuple observation's arrays back to back; a sandbox of several envs with a Dict/Tuple keeps
each array's rows back to back instead, one array after the other), maps it and answers with the memfd's descriptor
number and size. The worker takes the descriptor out of this process (``pidfd_getfd``), seals it
against shrinking and growing, and passes it to the pool, which maps it read-only. From then on
a plain reply writes its observation into the slot and carries a reference (``{"__shm__": [slot,
dtype, shape]}``) instead of the bytes.

Only the sizes are this process's to choose, and the pool checks them against the declared
space; the seals (set by the worker, not here) make sure this process can never shrink the
memfd under the pool's mapping. The env writes into the region only once the worker says so
(``{"op": "obs_region", "use": true}``, sent after the seals are in force): a region the worker
refused is never used, and the env keeps sending bytes. Nothing here is trusted by anyone else.

A process holds at most one region (:func:`current`). A process forked from one that had a region
(a memory snapshot's copy) must :func:`forget` it before it serves: it would otherwise write into
its source's region.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable

__all__ = ["ObsRegion", "create", "current", "forget", "on_forget", "MEMFD_NAME"]

#: The memfd's name (``/proc/<pid>/fd`` shows ``/memfd:boltzlabs-obs``); the worker checks it.
MEMFD_NAME = "boltzlabs-obs"


class ObsRegion:
    """One mapped memfd of ``slots`` slots of ``slot_bytes`` each, back to back (so that a sandbox's
    rows are one block), its size rounded up to whole pages.

    Mapped with libc's ``mmap`` (Python's ``mmap`` keeps a duplicate of the descriptor, and a
    memory snapshot refuses an env with open files): once the worker has its own copy of the
    descriptor, :meth:`close_fd` leaves the process with the mapping alone.

    >>> region = ObsRegion(2, 16)
    >>> region.size
    4096
    >>> region.view(1)[:4] = b"abcd"; bytes(region.memory[16:20])
    b'abcd'
    >>> region.close()
    """

    def __init__(self, slots: int, slot_bytes: int):
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"an observation region needs slots >= 1 and slot_bytes >= 1, got {slots}, {slot_bytes}")
        page = mmap.PAGESIZE
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.size = max(1, -(-(slots * slot_bytes) // page)) * page
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._addr = _mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.memory = memoryview((ctypes.c_char * self.size).from_address(self._addr)).cast("B")

    def view(self, slot: int) -> memoryview:
        """The writable bytes of ``slot``."""
        start = slot * self.slot_bytes
        return self.memory[start : start + self.slot_bytes]

    def close_fd(self) -> None:
        """Close the memfd's descriptor here (the mapping stays)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap and close the memfd (the pool's and the worker's copies live on). Every view of it
        must be gone first (:func:`on_forget`)."""
        self.close_fd()
        if self._addr:
            self.memory.release()
            _libc.munmap(ctypes.c_void_p(self._addr), ctypes.c_size_t(self.size))
            self._addr = 0


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap(fd: int, size: int) -> int:
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of the observation region: {os.strerror(err)}")
    return int(addr)


_current: ObsRegion | None = None
_users: list[Callable[[], None]] = []


def create(slots: int, slot_bytes: int) -> ObsRegion:
    """This process's region, made on first call. A second call with the same sizes returns it while
    its descriptor is still open here (not passed on yet); else the old region is dropped
    (:func:`forget`) and a new one made: the pool asks again when it lost its mapping."""
    global _current
    if _current is not None and _current.fd < 0:
        forget()
    if _current is not None:
        if (_current.slots, _current.slot_bytes) != (slots, slot_bytes):
            raise ValueError("this process already has an observation region of other sizes")
        return _current
    _current = ObsRegion(slots, slot_bytes)
    return _current


def current() -> ObsRegion | None:
    """This process's region, if it made one."""
    return _current


def on_forget(callback: Callable[[], None]) -> None:
    """Have ``callback`` called by :func:`forget`, first: a user of the region lets go of its views
    (and writes its observations elsewhere from then on)."""
    _users.append(callback)


def forget() -> None:
    """Drop this process's region (its users let go of it, then unmap, close): a forked copy must
    never write into its source's region."""
    global _current
    region, _current = _current, None
    users = _users[:]
    _users.clear()
    for callback in users:
        callback()
    if region is not None:
        region.close()
