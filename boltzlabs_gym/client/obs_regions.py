"""A local pool's shared observation regions: one read-only mapping per env process.

A pool that started its own worker (``RLPool(shared_obs=True)``, the default) asks each env
process for an observation region (an ``obs_region`` item, through the worker). The env makes a
memfd with one slot per env it hosts, the worker takes it out of the env, seals it against any
change of size and passes the descriptor with its reply (see
:mod:`boltzlabs_gym.worker.obs_regions`); :meth:`ObsRegions.adopt` checks the seals and the size
again (it costs nothing) and maps it read-only. From then on that env's plain replies (a plain
step, a plain reset, a sandbox reply's rows) write the observation into its slot and carry a
reference, ``{"__shm__": [slot, dtype, shape]}``, instead of the bytes.

:meth:`ObsRegions.resolve` turns every reply that refers to a region back into the reply the env
would have sent without one, *copying the slot out as the reply is read*: the rest of the pool
reads it as it always did (and validates it against the space as it always did), and an env that
rewrites its slot afterwards changes nothing already read. A reference from an env that has no
region here, or one whose slot, dtype or shape is not its region's, is that env's fault
(:class:`RegionFault`), as a malformed payload is.

A caller that copies every observation it reads into memory of its own before anything else
sees it (the vector env's step, which copies each row into its batch) may read the slots in
place instead: inside :meth:`ObsRegions.lending_views`, a resolved reply's observation payload
is a read-only view of the slot, not a copy, and the caller's own copy is the only one. The
slot is still read only after the env's reply; an env that rewrites it during that copy tears
its own observation, nobody else's. Nothing outside the block may keep such a view.

An env of one process with a Dict/Tuple observation of fixed-size arrays has a slot that holds
those arrays' payloads back to back (its ``layout``): its reply is encoded as always, with those
payloads empty and ``"__shm__": [0, count]`` saying they are in the slot;
:meth:`ObsRegions.resolve` fills them in from it. A sandbox of several envs whose observations
are a Dict/Tuple of arrays only keeps its sandbox reply's rows in its region, each array's rows
back to back (``m`` of them), one array after the other; its reply's ``obs`` is their skeleton
with ``"__shm__"`` leaves (:func:`~boltzlabs_gym.wire.slot_layout.rows_skeleton`).

A one-env step whose info is typed columns (:mod:`~boltzlabs_gym.wire.info_layout`: numbers, the
same keys step after step, as ALE's and MuJoCo's) refers to its slot the same way, its columns'
payloads after the (empty) observation's. Replies that carry anything else (other infos,
autoreset's ``reset_obs``, errors, other spaces) stay bytes. A process the pool learns was
replaced (a failure, a hard reset, a restore) loses its mapping here and is asked again before
its next call; until then it answers with bytes. Remote pools never ask: their wire is unchanged.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..wire.codec import ND, SHM, ArrayLeaf
from ..wire.protocol import MAX_KNOWN_LINE_BYTES, OK, REGION_FDS_TAKEN, parse_json
from ..wire.slot_layout import array_bytes, copy_skeleton, layout_spans, rows_skeleton, skeleton_fits
from .results import EnvResult

log = logging.getLogger(__name__)

__all__ = ["ObsRegions", "RegionFault", "REQUIRED_SEALS", "KEEPS_REGION"]

#: Item ops after which an env process is still the one that had the region. Any other (a hard
#: reset, a restore, a snapshot, a lent env's fault, ...) may replace it: its region is asked again.
KEEPS_REGION = frozenset(("step", "reset", "obs_region", "describe", "call", "get_attr", "set_attr", "render"))

#: The seals a region must carry before it is mapped: nobody can shrink (or grow) it any more.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
#: The largest region mapped.
MAX_REGION_BYTES = 1 << 30
_SHM_KEY = b'"__shm__"'


class RegionFault(Exception):
    """An env's reply refers to its region wrongly; ``reason`` says how (the env is handed back)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Region:
    """One env process's region, mapped read-only, and the one-env step line it rewrites.

    A slot holds one array (``dtype`` and ``shape``), or a Dict/Tuple observation's payloads
    back to back (``spans``: each one's ``(start, size)``; ``dtype`` and ``shape`` are then
    ``None``, and so is ``leaf`` unless the observation is arrays only: ``skeleton``).
    """

    __slots__ = (
        "map",
        "view",
        "slots",
        "slot_bytes",
        "dtype",
        "shape",
        "leaf",
        "spans",
        "skeleton",
        "known_sandbox_line",
    )

    def __init__(
        self,
        fd: int,
        size: int,
        slots: int,
        slot_bytes: int,
        dtype: np.dtype | None,
        shape: tuple | None,
        spans: tuple[tuple[int, int], ...] | None = None,
        skeleton: Any = None,
    ):
        # (Python's mmap keeps a duplicate of ``fd`` until it is closed: one descriptor per mapping)
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.view = memoryview(self.map)  # read-only, as the mapping
        self.slots, self.slot_bytes, self.dtype, self.shape, self.spans = slots, slot_bytes, dtype, shape, spans
        #: A Dict/Tuple of arrays only: the skeleton its observations encode to. Its plain step is
        #: one line that refers to the whole slot as bytes (read with ``leaf``, over those bytes).
        self.skeleton = skeleton
        # a one-env process's plain step line, rewritten without a JSON parser (ArrayLeaf.shm_to_step_line)
        self.leaf: ArrayLeaf | None = None
        if skeleton is not None:
            self.leaf = ArrayLeaf(_ShapeOnly(np.dtype(np.uint8), (slot_bytes,)))  # type: ignore[arg-type]
        elif dtype is not None:
            self.leaf = ArrayLeaf(_ShapeOnly(dtype, shape))  # type: ignore[arg-type]
        #: The last all-plain sandbox reply line that referred to these rows, as ``(line, its rows,
        #: the line rewritten to refer to them as payloads)``: a sandbox sends the same line on every
        #: plain step, and it is checked once.
        self.known_sandbox_line: tuple[bytes, int, bytes] | None = None

    def copy_rows(self, rows: int) -> bytes:
        """The first ``rows`` slots' bytes, copied out now."""
        return self.map[: rows * self.slot_bytes]

    def view_rows(self, rows: int) -> memoryview:
        """The first ``rows`` slots in place (read-only; see :meth:`ObsRegions.lending_views`)."""
        return self.view[: rows * self.slot_bytes]

    def close(self) -> None:
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            # A view lent out is still alive (an exception's traceback holds a step's locals): the
            # mapping goes when the last view does.
            log.debug("a shared observation region was still viewed when its env was replaced")


class _ShapeOnly:
    """What :class:`ArrayLeaf` reads of a space: its dtype and shape."""

    def __init__(self, dtype: np.dtype, shape: tuple):
        self.dtype, self.shape = dtype, shape


class ObsRegions:
    """The regions of one local worker's env processes (``count`` of them, ``envs_per_sandbox``
    envs each), by the worker's index of the process.

    :meth:`due` lists the processes to ask (none asked yet, or replaced since);
    :meth:`adopt` maps what a batch reply passed; :meth:`resolve` reads a reply against them;
    :meth:`forget` drops one (its process was replaced); :meth:`close` unmaps them all.
    """

    def __init__(self, count: int, envs_per_sandbox: int = 1):
        self.count = count
        self.envs_per_sandbox = envs_per_sandbox
        self._regions: dict[int, _Region] = {}
        self._due: set[int] = set(range(count))
        #: Processes that answered that they cannot have one (no array space, no memfd): not asked again.
        self.refused: dict[int, str] = {}
        #: Inside :meth:`lending_views`: observations are read in place, not copied out.
        self.views = False

    def __contains__(self, index: int) -> bool:
        return index in self._regions

    def __len__(self) -> int:
        return len(self._regions)

    def due(self) -> list[int]:
        """Processes to ask for a region before their next call."""
        return sorted(self._due)

    def forget(self, index: int) -> None:
        """Env process ``index`` was (or may have been) replaced: unmap its region, ask again."""
        region = self._regions.pop(index, None)
        if region is not None:
            region.close()
        if index not in self.refused:
            self._due.add(index)

    def close(self) -> None:
        for index in list(self._regions):
            self._regions.pop(index).close()
        self._due.clear()

    # ------------------------------------------------------------------ adopting
    def adopt(self, header: dict, results: list[EnvResult], start: int = 0) -> None:
        """Map the regions a batch reply passed (``results``: its parsed results, ``start``: the
        link's first index); close every descriptor that came with it."""
        fds = header.pop(REGION_FDS_TAKEN, [])
        try:
            for r in results:
                reply = r.reply
                if not isinstance(reply, dict) or ("obs_region" not in reply and "error" not in reply):
                    continue
                index = r.index - start
                if not 0 <= index < self.count or index not in self._due:
                    continue
                self._due.discard(index)
                why = self._adopt_one(index, reply, fds) if r.status == OK else str(reply.get("message"))
                if why is not None:
                    log.debug("env process %d keeps sending observations as bytes: %s", index, why)
                    if r.status == OK:
                        self.refused[index] = why
                    else:
                        self._due.add(index)
        finally:
            for fd in fds:
                os.close(fd)

    def _adopt_one(self, index: int, reply: dict, fds: list[int]) -> str | None:
        """Map process ``index``'s region as ``reply`` describes it; why not (``None``: mapped)."""
        described = reply.get("obs_region")
        if not isinstance(described, dict):
            return str(reply.get("error", "no region"))[:300]
        dtype: np.dtype | None = None
        shape: tuple | None = None
        spans: tuple[tuple[int, int], ...] | None = None
        skeleton: Any = None
        try:
            k = described["fd_index"]
            size, slots, slot_bytes = described["bytes"], described["slots"], described["slot_bytes"]
            ok = all(type(v) is int for v in (k, size, slots, slot_bytes)) and 0 <= k < len(fds)
            ok = ok and 1 <= slots <= self.envs_per_sandbox
            if "layout" in described:  # a Dict/Tuple observation's payloads
                spans = layout_spans(described["layout"])
                ok = ok and spans is not None and slot_bytes == sum(n for _, n in spans)
                skeleton = described.get("skeleton")
                ok = ok and (skeleton is None or skeleton_fits(skeleton, described["layout"]))
                # several envs: a sandbox's rows, which only a Dict/Tuple of arrays only has
                ok = ok and (slots == 1 or skeleton is not None)
            else:
                dtype, shape = np.dtype(described["dtype"]), tuple(described["shape"])
                ok = ok and array_bytes(dtype, shape) == slot_bytes
            ok = ok and 0 < slots * slot_bytes <= size <= MAX_REGION_BYTES
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            return f"the worker described its region wrongly: {str(described)[:200]}"
        fd = fds[k]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            st = os.fstat(fd)
        except OSError as exc:
            return f"its descriptor is not a sealable memfd: {exc}"
        if seals & REQUIRED_SEALS != REQUIRED_SEALS or not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return f"its memfd is not sealed against shrinking at {size} bytes (seals {seals:#x}, {st.st_size} bytes)"
        try:
            self._regions[index] = _Region(fd, size, slots, slot_bytes, dtype, shape, spans, skeleton)
        except OSError as exc:  # out of descriptors or address space here: bytes it is
            return f"it could not be mapped: {exc}"
        return None

    # ------------------------------------------------------------------ reading
    @contextmanager
    def lending_views(self) -> Iterator[None]:
        """Within the block, :meth:`resolve` hands observations over as read-only views of their
        slots instead of copies: for a caller that copies each one into memory of its own (and
        keeps no view past the block)."""
        self.views = True
        try:
            yield
        finally:
            self.views = False

    def resolve(self, index: int, line: bytes, payloads: list) -> tuple[bytes | None, dict | None, list]:
        """A reply of process ``index`` as it would be without a region: ``(line, None, payloads)``
        when it needs no change (or is a one-env plain step line, or an all-plain sandbox reply's
        line read before, rewritten), ``(None, reply, payloads)`` with the parsed reply otherwise.
        The slot is copied out here. Raises :class:`RegionFault` for a reference this process may
        not make."""
        region = self._regions.get(index)
        # (a one-env step line only from a process of one env: a sandbox of several answers in sandbox replies)
        if region is not None and region.slots == 1 and region.leaf is not None and payloads and not len(payloads[0]):
            if len(payloads) == 1:
                step_line = region.leaf.shm_to_step_line(line)
                if step_line is not None and region.skeleton is not None:
                    return self._arrays_step(region, step_line)
            elif region.skeleton is None:  # a step whose info is typed columns, after the observation
                step_line = region.leaf.shm_to_info_step_line(line)
            else:
                step_line = None
            if step_line is not None:
                return step_line, None, [region.view_rows(1) if self.views else region.copy_rows(1), *payloads[1:]]
        known = region.known_sandbox_line if region is not None else None
        if region is not None and known is not None and line == known[0]:  # the usual sandbox reply
            return known[2], None, self._rows_as_payloads(region, known[1], payloads)
        if _SHM_KEY not in line:
            return line, None, payloads
        try:
            reply = parse_json(line)
        except ValueError:
            return line, None, payloads  # a bad reply, said as such by whoever parses it
        if isinstance(reply, dict) and SHM in reply:  # a Dict/Tuple observation's payloads
            return None, reply, self._payloads_from(region, reply, payloads)
        ref = reply.get("obs") if isinstance(reply, dict) else None
        if isinstance(ref, (dict, list)) and "n" in reply and region is not None and region.skeleton is not None:
            return None, reply, self._sandbox_rows(region, line, reply, payloads)
        if not (isinstance(ref, dict) and SHM in ref):
            return line, None, payloads  # the key elsewhere (an info's): not a reference
        if region is None:
            raise RegionFault("its reply refers to a shared observation region it does not have")
        dtype, shape = region.dtype, region.shape
        if dtype is None or shape is None:
            raise RegionFault("its reply refers to one array in a region that holds a Dict/Tuple observation")
        if "n" in reply:  # a sandbox reply: its rows, in place of its (empty) first payload
            rows = reply.get("n")
            if type(rows) is not int or not 0 < rows <= region.slots:
                raise RegionFault(f"its sandbox reply has {str(rows)[:20]} positions for {region.slots} slots")
            expected = [0, dtype.str, [rows, *shape]]
            copied = self._rows_as_payloads(region, rows, payloads)
            resolved = expected
        else:  # one env's reply: its observation becomes a payload after the others
            rows, expected = 1, [0, dtype.str, list(shape)]
            copied = [*payloads, region.copy_rows(1)]
            resolved = [len(payloads), *expected[1:]]
        if region.slots != 1 and "n" not in reply or ref != {SHM: expected}:
            raise RegionFault(f"its reply refers to {str(ref)[:120]}, not its region's {expected}")
        reply["obs"] = {ND: resolved}
        if "n" in reply:
            self._remember_sandbox(region, line, rows, reply)
        return None, reply, copied

    def _sandbox_rows(self, region: _Region, line: bytes, reply: dict, payloads: list) -> list:
        """The payloads of a sandbox reply of a Dict/Tuple of arrays only whose rows are in the
        region (each array's rows back to back, one array after the other): each array's first
        ``P`` rows read from there, in place of their empty payloads; ``reply["obs"]`` then refers
        to them as payloads. Rows sent as bytes are left as they are."""
        rows = reply.get("n")
        if type(rows) is not int or not 0 < rows <= region.slots:
            raise RegionFault(f"its sandbox reply has {str(rows)[:20]} positions for {region.slots} slots")
        if reply["obs"] != rows_skeleton(region.skeleton, rows, SHM):
            if reply["obs"] == rows_skeleton(region.skeleton, rows):
                return payloads
            raise RegionFault(f"its sandbox reply's observations {str(reply['obs'])[:120]} are not its region's rows")
        copied = self._rows_as_payloads(region, rows, payloads)
        reply["obs"] = rows_skeleton(region.skeleton, rows)
        self._remember_sandbox(region, line, rows, reply)
        return copied

    def _rows_as_payloads(self, region: _Region, rows: int, payloads: list) -> list:
        """A sandbox reply's payloads with its first ``rows`` rows of each array read from the region
        in place of the empty payloads it sent for them (one array's, or a Dict/Tuple's each)."""
        spans = region.spans
        if spans is None:  # one array's rows
            if not payloads or len(payloads[0]):
                raise RegionFault("its sandbox reply refers to its region but sends the observations' bytes too")
            payloads = list(payloads)
            payloads[0] = region.view_rows(rows) if self.views else region.copy_rows(rows)
            return payloads
        taken = len(spans)
        if len(payloads) < taken or any(len(p) for p in payloads[:taken]):
            raise RegionFault("its sandbox reply refers to its region but sends the observations' bytes too")
        m, data = region.slots, region.view if self.views else region.map
        return [data[m * start : m * start + rows * size] for start, size in spans] + payloads[len(spans) :]

    @staticmethod
    def _remember_sandbox(region: _Region, line: bytes, rows: int, resolved: dict) -> None:
        """Keep an all-plain sandbox reply's line read against the region, and the line that says
        the same with its rows as payloads (``resolved``, the reply rewritten), for
        :meth:`resolve` to answer the same line again without parsing it. Its payloads' sizes
        are the line's (the pipe's reader holds a reply to the sizes its line announces). A long
        line is not kept (:data:`~boltzlabs_gym.wire.protocol.MAX_KNOWN_LINE_BYTES`), nor one that
        cannot be written back (nested to just below what the parser takes)."""
        if resolved.get("replies") or len(line) > MAX_KNOWN_LINE_BYTES:
            return
        try:
            rewritten = (json.dumps(resolved, separators=(",", ":")) + "\n").encode()
        except (RecursionError, ValueError, TypeError):
            return
        region.known_sandbox_line = (line, rows, rewritten)

    def _arrays_step(self, region: _Region, step_line: bytes) -> tuple[None, dict, list]:
        """The plain step of a Dict/Tuple of arrays (its line, rewritten as one array's): the reply
        it stands for, with the skeleton all such observations have and the arrays' payloads
        read from the slot."""
        assert region.leaf is not None and region.spans is not None
        parsed = region.leaf.parse_step_line(step_line)
        if parsed is None:
            raise RegionFault("its step line refers to its region but is not a plain step's")
        reward, terminated, truncated = parsed
        reply = {
            "obs": copy_skeleton(region.skeleton),  # the reader may keep it: a copy of its own
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "info": {},
        }
        return None, reply, self._slot_payloads(region, region.spans)

    def _slot_payloads(self, region: _Region, spans: tuple[tuple[int, int], ...]) -> list:
        """The payloads a slot holds back to back: views inside :meth:`lending_views`, else copies."""
        if self.views:
            view = region.view
            return [view[start : start + size] for start, size in spans]
        data = region.map
        return [data[start : start + size] for start, size in spans]

    def _payloads_from(self, region: _Region | None, reply: dict, payloads: list) -> list:
        """The payloads of a reply whose first ones (a Dict/Tuple observation's) are in the env's
        slot (``"__shm__": [0, count]``, their places empty): read from the slot, the rest as sent."""
        if region is None:
            raise RegionFault("its reply refers to a shared observation region it does not have")
        spans = region.spans
        if spans is None:
            raise RegionFault("its reply refers to observation payloads in a region that holds one array")
        ref = reply.pop(SHM)
        if ref != [0, len(spans)] or region.slots != 1:
            raise RegionFault(f"its reply refers to {str(ref)[:60]}, not its region's [0, {len(spans)}]")
        if len(payloads) < len(spans) or any(len(p) for p in payloads[: len(spans)]):
            raise RegionFault("its reply refers to its region but sends the observation's bytes too")
        return self._slot_payloads(region, spans) + payloads[len(spans) :]

    def resolve_result(self, result: EnvResult, start: int = 0) -> EnvResult:
        """:meth:`resolve` a raw result in place (``start``: the link's first index); an OK result only."""
        if result.status != OK or result.raw is None:
            return result
        line, reply, payloads = self.resolve(result.index - start, result.raw, result.payloads)
        result.raw, result.reply, result.payloads = line, reply, payloads
        return result
