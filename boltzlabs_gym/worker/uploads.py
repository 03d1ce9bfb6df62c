"""Uploaded env archives, unpacked off the worker's event loop.

An upload may unpack to hundreds of MiB and tens of thousands of files: seconds of work.
Done inside the event loop, it would stall every other session on the worker for that
long (their steps, their deadlines, their heartbeats). Here each archive is hashed and
unpacked on a thread of its own; the loop watches :meth:`Uploads.fileno` and collects
what finished with :meth:`Uploads.finished`, then answers the clients that asked.

The threads run only :func:`~boltzlabs_gym.archive.unpack_archive` (decompression,
hashing and file writes release the GIL for most of their time) and touch nothing of
the worker's state: everything they produce goes through :meth:`finished`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

from ..archive import ArchiveLimits, unpack_archive
from .host import drain_fd, make_tree_readable

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Upload:
    """One archive being unpacked, and everyone waiting for it."""

    digest: str
    dest: str
    #: Opaque tokens of the requests to answer when it is done (the worker's ``(client, seq)``).
    waiters: list
    #: Set by the thread: ``None`` when ``dest`` holds the archive, else what went wrong.
    error: BaseException | None = None
    thread: threading.Thread | None = None


class Uploads:
    """Unpacks archives on background threads and tells the event loop when each is done.

    Used by the worker like this::

        uploads = Uploads(limits)
        epoll.register(uploads.fileno(), select.EPOLLIN)
        uploads.submit(digest, data, dest, waiter=(client, seq))
        ...                                    # when uploads.fileno() is readable:
        for up in uploads.finished():
            answer(up.waiters, up.error)       # error is None: dest holds the archive
    """

    def __init__(self, limits: ArchiveLimits):
        self.limits = limits
        self._done_r, self._done_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._running: dict[str, Upload] = {}
        self._done: list[Upload] = []
        self._cancel = threading.Event()

    def fileno(self) -> int:
        """Readable when an upload finished (see :meth:`finished`)."""
        return self._done_r

    def in_progress(self, digest: str) -> bool:
        return digest in self._running

    def submit(self, digest: str, data: bytes, dest: str, waiter) -> None:
        """Unpack ``data`` (announced as ``digest``) into ``dest``, and answer ``waiter`` when done.

        An archive already being unpacked is not unpacked twice: ``waiter`` joins the
        requests waiting for it.
        """
        running = self._running.get(digest)
        if running is not None:
            running.waiters.append(waiter)
            return
        up = Upload(digest, dest, [waiter])
        up.thread = threading.Thread(target=self._unpack, args=(up, data), name=f"unpack-{digest[:12]}", daemon=True)
        self._running[digest] = up
        up.thread.start()

    def _unpack(self, up: Upload, data: bytes) -> None:
        try:
            unpack_archive(data, up.dest, expected_hash=up.digest, limits=self.limits, cancel=self._cancel)
            make_tree_readable(up.dest)
        except BaseException as exc:  # noqa: BLE001 - reported to the clients that sent it
            up.error = exc
        with self._lock:
            self._done.append(up)
        try:
            os.write(self._done_w, b"\0")
        except BlockingIOError:
            pass  # the loop has wake-ups pending already

    def finished(self) -> list[Upload]:
        """The uploads that finished since the last call (call when :meth:`fileno` is readable)."""
        drain_fd(self._done_r)
        with self._lock:
            done, self._done = self._done, []
        for up in done:
            del self._running[up.digest]
            up.thread.join()
        return done

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the uploads still unpacking (their staging trees are removed) and wait for them."""
        self._cancel.set()
        for up in list(self._running.values()):
            up.thread.join(timeout)
            if up.thread.is_alive():
                log.warning("upload %s still unpacking after %.0f s at shutdown", up.digest[:12], timeout)
        for fd in (self._done_r, self._done_w):
            os.close(fd)
