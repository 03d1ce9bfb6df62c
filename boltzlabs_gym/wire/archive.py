"""Deterministic env-directory archives and their safe unpacking.

The trainer packs an env directory once (:func:`pack_dir`); the same tree always
gives the same bytes and so the same SHA-256, which is how workers cache it. The
worker unpacks with :func:`unpack_archive`, which refuses anything that could
escape the target directory or exhaust the disk.

>>> data, digest = pack_dir("envs/counter")          # doctest: +SKIP
>>> unpack_archive(data, "/tmp/x", expected_hash=digest)  # doctest: +SKIP
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import threading
import zlib
from dataclasses import dataclass

from ..errors import ArchiveError

#: Names never packed: caches and VCS data are not part of an env.
_SKIP_NAMES = {"__pycache__", ".git", ".hg", ".svn", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class ArchiveLimits:
    """What a worker accepts: unpacked bytes, packed bytes, number of entries."""

    max_unpacked_bytes: int = 512 << 20
    max_packed_bytes: int = 128 << 20
    max_files: int = 20_000


def _walk_sorted(root: str):
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_NAMES)
        rel_dir = os.path.relpath(dirpath, root)
        entries = [(d, True) for d in dirnames] + [
            (f, False) for f in filenames if f not in _SKIP_NAMES and not f.endswith(_SKIP_SUFFIXES)
        ]
        for name, _ in sorted(entries):
            rel = name if rel_dir == "." else posixpath.join(rel_dir.replace(os.sep, "/"), name)
            yield rel, os.path.join(dirpath, name)


def _normalised_info(rel: str, path: str, root: str) -> tuple[tarfile.TarInfo, bytes | None]:
    st = os.lstat(path)
    info = tarfile.TarInfo(rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
        if os.path.isabs(target) or not (resolved + os.sep).startswith(os.path.abspath(root) + os.sep):
            raise ArchiveError(f"{rel}: symlink to {target!r} leaves the env directory; copy the file in instead")
        info.type = tarfile.SYMTYPE
        info.linkname = target
        info.mode = 0o777
        return info, None
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        return info, None
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            data = f.read()
        info.size = len(data)
        info.mode = 0o755 if st.st_mode & 0o111 else 0o644
        return info, data
    raise ArchiveError(f"{rel}: only regular files, directories and symlinks can be packed")


def pack_dir(path: str | os.PathLike) -> tuple[bytes, str]:
    """Pack ``path`` into a deterministic ``.tar.gz``; return ``(bytes, sha256 hex)``.

    Entries are sorted, owners and mtimes zeroed and modes normalised, so the same
    tree always yields the same bytes. Symlinks must stay inside the tree.
    """
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        raise ArchiveError(f"env directory {root!r} does not exist or is not a directory")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, full in _walk_sorted(root):
            info, data = _normalised_info(rel, full, root)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    packed = io.BytesIO()
    with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    blob = packed.getvalue()
    return blob, hashlib.sha256(blob).hexdigest()


def archive_hash(data: bytes) -> str:
    """The content address of an archive."""
    return hashlib.sha256(data).hexdigest()


_HASH = re.compile(r"[0-9a-f]{64}")


def is_archive_hash(text: object) -> bool:
    """Whether ``text`` has the form :func:`archive_hash` returns (safe as a file name).

    >>> is_archive_hash(archive_hash(b"")), is_archive_hash("../x")
    (True, False)
    """
    return isinstance(text, str) and _HASH.fullmatch(text) is not None


def _check_member(member: tarfile.TarInfo) -> str:
    name = member.name
    if name.startswith("/") or "\\" in name:
        raise ArchiveError(f"archive entry {name!r} has an absolute or Windows path")
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../") or "/../" in f"/{name}/":
        raise ArchiveError(f"archive entry {name!r} contains '..'")
    if member.issym():
        target = posixpath.normpath(posixpath.join(posixpath.dirname(norm), member.linkname))
        if member.linkname.startswith("/") or target == ".." or target.startswith("../"):
            raise ArchiveError(f"archive entry {name!r} links to {member.linkname!r}, outside the env directory")
    elif member.islnk():
        raise ArchiveError(f"archive entry {name!r} is a hard link; only files, dirs and symlinks are allowed")
    elif not (member.isfile() or member.isdir()):
        raise ArchiveError(f"archive entry {name!r} is a device, fifo or other special file")
    return norm


#: Most bytes of tar headers (ustar blocks, PAX records, GNU long names) read for one entry.
MAX_HEADER_BYTES = 4 << 20
#: Member data is copied out in reads of this size; a header read may not be larger.
_COPY_CHUNK = 1 << 20


class _GunzippedTar:
    """A forward-only file over the decompressed bytes of a gzip stream, for ``tarfile``.

    Nothing is decompressed ahead of what tarfile asks for, and every byte counts against
    the unpacked limit. No single header read may exceed :data:`_COPY_CHUNK`, and the
    header bytes read for one entry (:meth:`next_entry` starts the count) may not exceed
    :data:`MAX_HEADER_BYTES`: tarfile reads a PAX header or a GNU long name in one read of
    whatever size the header declares and holds every extended header it meets before the
    entry, so without these bounds a few KiB of gzip could make the worker hold hundreds
    of MiB.
    """

    def __init__(self, data: bytes, limits: ArchiveLimits, cancel: threading.Event | None = None):
        self._gz = gzip.GzipFile(fileobj=io.BytesIO(data))
        self._cancel = cancel
        self._limit = limits.max_unpacked_bytes + MAX_HEADER_BYTES
        self._max_unpacked = limits.max_unpacked_bytes
        self._pos = 0
        self._header_bytes = 0
        #: True while member data is being copied out (see :func:`_copy_member`).
        self.in_data = False

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or (not self.in_data and size > _COPY_CHUNK):
            raise ArchiveError(f"archive holds a tar header of {size} bytes; headers over {_COPY_CHUNK} are refused")
        if self._pos + size > self._limit:
            size = self._limit - self._pos + 1  # read one byte past the limit to tell
        if self._cancel is not None and self._cancel.is_set():
            raise ArchiveError("unpacking was cancelled (the worker is shutting down)")
        try:
            chunk = self._gz.read(size)
        except (OSError, EOFError, zlib.error) as exc:
            raise ArchiveError(f"archive is not a valid gzip stream: {exc}") from None
        self._pos += len(chunk)
        if self._pos > self._limit:
            raise ArchiveError(f"archive unpacks to more than {self._max_unpacked} bytes (the worker's limit)")
        if not self.in_data:
            self._header_bytes += len(chunk)
            if self._header_bytes > MAX_HEADER_BYTES:
                raise ArchiveError(f"archive holds more than {MAX_HEADER_BYTES} bytes of tar headers for one entry")
        return chunk

    def next_entry(self) -> None:
        """The previous entry is done: count header bytes afresh."""
        self._header_bytes = 0

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Forward only: skipping the padding after a member, or data tarfile did not read."""
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence != io.SEEK_SET:
            raise ArchiveError("archive stream cannot seek from its end")
        if offset < self._pos:
            raise ArchiveError("archive stream cannot seek backwards (is it a valid tar?)")
        while self._pos < offset:
            if not self.read(min(offset - self._pos, _COPY_CHUNK)):
                break
        return self._pos


def _safe_target(root: str, norm: str, name: str) -> str:
    """Where entry ``norm`` goes under ``root``, its missing parents made as real directories.

    Refused: a path through anything but a real directory (a symlink, however it
    resolves, or a file), so nothing is ever created by following a link.
    """
    parts = norm.split("/")
    path = root
    for depth, part in enumerate(parts[:-1], 1):
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.mkdir(path, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            what = "symlink" if stat.S_ISLNK(st.st_mode) else "file"
            raise ArchiveError(
                f"archive entry {name!r} would be written through the {what} {'/'.join(parts[:depth])!r}"
            )
    return os.path.join(path, parts[-1])


def _refuse_existing(target: str, name: str, is_dir: bool) -> None:
    """An entry may not replace or follow one already unpacked (only a directory may repeat)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if not (is_dir and stat.S_ISDIR(st.st_mode)):
        raise ArchiveError(f"archive has two entries at {name!r}")


def _copy_member(tar: tarfile.TarFile, member: tarfile.TarInfo, stream: _GunzippedTar, target: str) -> None:
    src = tar.extractfile(member)
    if src is None:  # _check_member lets only regular files reach here, and those have data
        raise ArchiveError(f"archive entry {member.name!r} is not a regular file")
    # O_EXCL | O_NOFOLLOW: never through a link, never over something already there.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    stream.in_data = True
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := src.read(_COPY_CHUNK):
                out.write(chunk)
            os.fchmod(out.fileno(), 0o755 if member.mode & 0o111 else 0o644)
    finally:
        stream.in_data = False


def _unpack_entry(tar: tarfile.TarFile, member: tarfile.TarInfo, stream: _GunzippedTar, root: str, norm: str) -> None:
    target = _safe_target(root, norm, member.name)
    _refuse_existing(target, member.name, member.isdir())
    if member.isdir():
        os.makedirs(target, 0o755, exist_ok=True)
    elif member.issym():
        os.symlink(member.linkname, target)
    else:
        _copy_member(tar, member, stream, target)


def _check_links_stay_inside(root: str, links: list[tuple[str, str]]) -> None:
    """Each link checked lexically can still leave the tree through a chain of links
    (``s -> .`` then ``t -> s/..``), and a later entry can complete such a chain, so every
    link is resolved against the finished tree."""
    real_root = os.path.realpath(root)
    for path, name in links:
        real = os.path.realpath(path)
        if real != real_root and not real.startswith(real_root + os.sep):
            raise ArchiveError(f"archive entry {name!r} links outside the env directory through other links")


def _drain(stream: _GunzippedTar) -> None:
    """Read past the tar's end so gzip checks its CRC and length; a little padding is normal."""
    stream.in_data = True
    trailing = 0
    while chunk := stream.read(_COPY_CHUNK):
        trailing += len(chunk)
        if trailing > _COPY_CHUNK:
            raise ArchiveError("archive has more than 1 MiB of data after the end of its tar")


def _unpack_checked(data: bytes, root: str, limits: ArchiveLimits, cancel: threading.Event | None) -> None:
    """Stream the archive into ``root``, checking each entry before it is written."""
    stream = _GunzippedTar(data, limits, cancel)
    try:
        # No `with`: the TarFile reads a stream this function owns and drains itself; closing a
        # read-mode TarFile over a passed-in fileobj releases nothing. The ignore: typeshed's
        # overloads want an IO[bytes], and _GunzippedTar is a duck-typed forward-only reader.
        tar = tarfile.open(fileobj=stream, mode="r:")  # type: ignore[call-overload]  # noqa: SIM115
    except tarfile.TarError as exc:
        raise ArchiveError(f"archive is not a valid tar: {exc}") from None
    count = total = 0
    links: list[tuple[str, str]] = []
    while True:
        try:
            member = tar.next()
        except tarfile.TarError as exc:
            raise ArchiveError(f"archive is not a valid tar: {exc}") from None
        if member is None:
            break
        stream.next_entry()
        if tar.pax_headers:
            # Global headers pile up in tarfile across entries; pack_dir never writes one.
            raise ArchiveError(
                "archive has a global PAX header; pack env directories with boltzlabs_gym.wire.archive.pack_dir"
            )
        tar.members.clear()  # entries are handled one at a time; keep none of them
        count += 1
        if count > limits.max_files:
            raise ArchiveError(f"archive has {count} entries or more, over the worker's limit of {limits.max_files}")
        norm = _check_member(member)
        total += max(member.size, 0)
        if total > limits.max_unpacked_bytes:
            raise ArchiveError(f"archive unpacks to more than {limits.max_unpacked_bytes} bytes")
        if norm == ".":
            continue
        try:
            _unpack_entry(tar, member, stream, root, norm)
        except (OSError, tarfile.TarError) as exc:
            raise ArchiveError(f"archive entry {member.name!r} could not be unpacked: {exc}") from None
        if member.issym():
            links.append((os.path.join(root, norm), member.name))
    _drain(stream)
    _check_links_stay_inside(root, links)


def unpack_archive(
    data: bytes,
    dest: str,
    *,
    expected_hash: str | None = None,
    limits: ArchiveLimits = ArchiveLimits(),
    cancel: threading.Event | None = None,
) -> None:
    """Validate and unpack an env archive into the empty or new directory ``dest``.

    Refused (:class:`ArchiveError`): a hash mismatch, absolute paths, ``..``,
    symlinks leaving the tree, hard links, special files, more than
    ``limits.max_files`` entries or more than ``limits.max_unpacked_bytes`` bytes,
    oversized tar headers. The archive is decompressed as it is read (memory stays
    small whatever it unpacks to) into a sibling staging directory that becomes ``dest``
    only if the whole archive passes: nothing appears at ``dest`` otherwise. Setting
    ``cancel`` (from another thread) stops the unpacking within one read of at most
    1 MiB, with an :class:`ArchiveError`.
    """
    if len(data) > limits.max_packed_bytes:
        raise ArchiveError(f"archive is {len(data)} bytes, over the worker's limit of {limits.max_packed_bytes}")
    if expected_hash is not None and archive_hash(data) != expected_hash:
        raise ArchiveError("archive content does not match its announced hash")
    dest = os.path.abspath(dest)
    if os.path.isdir(dest) and os.listdir(dest):
        raise ArchiveError(f"cannot unpack into {dest!r}: the directory is not empty")
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", suffix=".unpacking", dir=parent)
    try:
        _unpack_checked(data, staging, limits, cancel)
        os.chmod(staging, 0o755)  # mkdtemp made it private; dest is an ordinary directory
        if os.path.isdir(dest):
            os.rmdir(dest)
        os.rename(staging, dest)
    except BaseException:
        # Every directory in it was made here, owner-writable: no permission repair needed
        # (unlike an env's workspace, whose modes the env chose: worker.host.wipe_tree).
        shutil.rmtree(staging, ignore_errors=True)
        raise
