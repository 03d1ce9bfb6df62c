"""Small kernel files (``/proc``, cgroupfs) read and written with plain ``os`` calls.

Every env's start and end reads and writes a handful of these: the worker its cgroup files, a
forked env its name, the code runner's wipe its ``/proc`` lists. A text-mode ``open()`` (a file
object, a buffer, a decoder) costs several times the system calls themselves, and in a freshly
forked interpreter copies the page of every object it touches. Standard library only: it runs
inside sandboxes too.
"""

from __future__ import annotations

import os

__all__ = ["read_bytes", "write_text"]


def read_bytes(path: str) -> bytes:
    """The whole of a small file at ``path`` (read until end of file: a ``/proc`` list may come in
    several reads)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_text(path: str, value: object) -> None:
    """Write ``str(value)`` to the existing file at ``path`` in one ``write`` (a cgroup or ``/proc``
    file takes a value per write); an ``OSError`` where the kernel refuses it."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)
