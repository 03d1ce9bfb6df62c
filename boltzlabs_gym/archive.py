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
import stat
import tarfile
from dataclasses import dataclass

from .errors import ArchiveError

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


def _read_bounded(data: bytes, limits: ArchiveLimits) -> bytes:
    if len(data) > limits.max_packed_bytes:
        raise ArchiveError(f"archive is {len(data)} bytes, over the worker's limit of {limits.max_packed_bytes}")
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as gz:
            raw = gz.read(limits.max_unpacked_bytes + (1 << 20) + 1)
    except (OSError, EOFError) as exc:
        raise ArchiveError(f"archive is not a valid gzip stream: {exc}") from None
    if len(raw) > limits.max_unpacked_bytes + (1 << 20):
        raise ArchiveError(f"archive unpacks to more than {limits.max_unpacked_bytes} bytes (the worker's limit)")
    return raw


def unpack_archive(
    data: bytes,
    dest: str,
    *,
    expected_hash: str | None = None,
    limits: ArchiveLimits = ArchiveLimits(),
) -> None:
    """Validate and unpack an env archive into the empty or new directory ``dest``.

    Refused (:class:`ArchiveError`): a hash mismatch, absolute paths, ``..``,
    symlinks leaving the tree, hard links, special files, more than
    ``limits.max_files`` entries or more than ``limits.max_unpacked_bytes`` bytes.
    Nothing is written unless the whole archive passes.
    """
    if expected_hash is not None and archive_hash(data) != expected_hash:
        raise ArchiveError("archive content does not match its announced hash")
    raw = _read_bounded(data, limits)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
        members = tar.getmembers()
    except tarfile.TarError as exc:
        raise ArchiveError(f"archive is not a valid tar: {exc}") from None
    if len(members) > limits.max_files:
        raise ArchiveError(f"archive has {len(members)} entries, over the worker's limit of {limits.max_files}")
    total = 0
    checked = []
    for member in members:
        norm = _check_member(member)
        total += max(member.size, 0)
        if total > limits.max_unpacked_bytes:
            raise ArchiveError(f"archive unpacks to more than {limits.max_unpacked_bytes} bytes")
        checked.append((norm, member))
    os.makedirs(dest, exist_ok=True)
    for norm, member in checked:
        if norm == ".":
            continue
        target = os.path.join(dest, norm)
        parent = os.path.dirname(target)
        os.makedirs(parent, exist_ok=True)
        if os.path.islink(parent) or not os.path.realpath(parent).startswith(os.path.realpath(dest)):
            raise ArchiveError(f"archive entry {member.name!r} would be written through a symlink")
        if member.isdir():
            os.makedirs(target, exist_ok=True)
        elif member.issym():
            os.symlink(member.linkname, target)
        else:
            src = tar.extractfile(member)
            with open(target, "wb") as out:
                out.write(src.read())
            os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
