"""Uploaded env archives, unpacked off the worker's event loop.

An upload may unpack to hundreds of MiB and tens of thousands of files: seconds of work.
Done inside the event loop, it would stall every other session on the worker for that
long (their steps, their deadlines, their heartbeats). Here archives are hashed and
unpacked on a background thread, one archive at a time (as the loop did them, so memory
and disk use stay what they were); the loop watches :meth:`Uploads.fileno` and collects
what finished with :meth:`Uploads.finished`, then answers the clients that asked.

The thread runs only :func:`~boltzlabs_gym.wire.archive.unpack_archive` and
:func:`~boltzlabs_gym.worker.host.make_tree_readable` and touches nothing of the worker's
state: what it produces goes through :meth:`Uploads.finished`, on the loop's thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading

from ..wire.archive import ArchiveLimits, unpack_archive
from .host import drain_fd, make_tree_readable

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Finished:
    """An upload's outcome, and the requests to answer with it."""

    digest: str
    dest: str
    #: ``None`` when ``dest`` holds the archive, else what went wrong.
    error: BaseException | None
    #: Opaque tokens of the requests to answer (the worker's ``(client, seq)``).
    waiters: list


@dataclasses.dataclass
class _Upload:
    digest: str
    dest: str
    #: ``(waiter, data)`` of every request for this digest not answered yet, in arrival
    #: order; the first one's data is the one being (or next to be) unpacked.
    senders: collections.deque
    thread: threading.Thread | None = None
    error: BaseException | None = None


class Uploads:
    """Unpacks archives on a background thread and tells the event loop when each is done.

    Used by the worker like this::

        uploads = Uploads(limits)
        epoll.register(uploads.fileno(), select.EPOLLIN)
        uploads.submit(digest, data, dest, waiter=(client, seq))
        ...                                    # when uploads.fileno() is readable:
        for done in uploads.finished():
            answer(done.waiters, done.error)   # error is None: dest holds the archive

    Requests for a digest already queued or unpacking wait for it rather than unpacking it
    again. Each keeps its own data: when one sender's archive fails (a wrong hash, a limit),
    only that sender gets the error and the next sender's data is tried, so one client
    cannot make another's upload of the same digest fail.
    """

    def __init__(self, limits: ArchiveLimits):
        self.limits = limits
        self._done_r, self._done_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()  # guards _done and _closed, shared with the thread
        self._done: list[_Upload] = []
        self._closed = False
        self._uploads: dict[str, _Upload] = {}  # the loop's thread only, as the rest below
        self._queue: collections.deque = collections.deque()
        self._current: _Upload | None = None
        self._cancel = threading.Event()

    def fileno(self) -> int:
        """Readable when an upload finished (see :meth:`finished`)."""
        return self._done_r

    def in_progress(self, digest: str) -> bool:
        """Whether ``digest`` is queued or being unpacked."""
        return digest in self._uploads

    def submit(self, digest: str, data: bytes, dest: str, waiter) -> None:
        """Unpack ``data`` (announced as ``digest``) into ``dest``, and answer ``waiter`` when done."""
        up = self._uploads.get(digest)
        if up is not None:
            up.senders.append((waiter, data))
            return
        up = _Upload(digest, dest, collections.deque([(waiter, data)]))
        self._uploads[digest] = up
        self._queue.append(up)
        self._start_next()

    def _start_next(self) -> None:
        if self._current is not None or not self._queue:
            return
        up = self._current = self._queue.popleft()
        data = up.senders[0][1]
        up.thread = threading.Thread(target=self._unpack, args=(up, data), name=f"unpack-{up.digest[:12]}", daemon=True)
        try:
            up.thread.start()
        except RuntimeError as exc:  # no thread to be had (a pids limit): this attempt failed
            up.thread, up.error = None, exc
            self._report(up)

    def _unpack(self, up: _Upload, data: bytes) -> None:
        try:
            unpack_archive(data, up.dest, expected_hash=up.digest, limits=self.limits, cancel=self._cancel)
            make_tree_readable(up.dest)
            up.error = None
        except BaseException as exc:  # noqa: BLE001 - reported to the client that sent it
            up.error = exc
        self._report(up)

    def _report(self, up: _Upload) -> None:
        with self._lock:
            if self._closed:
                return  # shut down meanwhile: nobody is left to answer
            self._done.append(up)
            try:
                os.write(self._done_w, b"\0")
            except BlockingIOError:
                pass  # the loop has wake-ups pending already

    def finished(self) -> list[Finished]:
        """The outcomes since the last call (call when :meth:`fileno` is readable)."""
        with self._lock:
            if self._closed:
                return []
            drain_fd(self._done_r)
            done, self._done = self._done, []
        out = []
        for up in done:
            if up.thread is not None:
                up.thread.join()
            self._current = None
            if up.error is None:
                out.append(Finished(up.digest, up.dest, None, [waiter for waiter, _ in up.senders]))
                del self._uploads[up.digest]
                continue
            waiter, _ = up.senders.popleft()
            out.append(Finished(up.digest, up.dest, up.error, [waiter]))
            if up.senders:
                self._queue.appendleft(up)  # the next sender's data, before other archives
            else:
                del self._uploads[up.digest]
        self._start_next()
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the unpacking in progress (its staging tree is removed) and wait for it,
        at most ``timeout`` seconds; queued uploads are dropped unanswered."""
        self._cancel.set()
        thread = self._current.thread if self._current is not None else None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("an upload was still unpacking %.0f s after the worker began shutting down", timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._done_r, self._done_w):
                os.close(fd)
