"""One cgroup per env for the memory and process limits (root only).

cgroup v2 with the memory and pids controllers (``memory.max``, ``pids.max``,
``memory.oom.group``, ``cgroup.kill``) is used where available; otherwise the v1
``memory`` and ``pids`` hierarchies. Per-env groups nest under the worker's own cgroup
in each hierarchy, so any outer limit stays in force.

The child joins its group itself (it writes ``0`` to ``cgroup.procs`` right after the
fork, before it can fork again), so no process of the env is ever outside it.
"""

from __future__ import annotations

import errno
import itertools
import os
import secrets
import signal
import time

from ...envside.plain_files import read_bytes, write_text

_CG = "/sys/fs/cgroup"
_counter = itertools.count()
_probe: tuple[str | None, str] | None = None


def _own_paths() -> dict[str, str]:
    own: dict[str, str] = {}
    for line in read_bytes("/proc/self/cgroup").decode().splitlines():
        _, ctrls, path = line.split(":", 2)
        if ctrls == "":
            own["<v2>"] = path
        for c in ctrls.split(","):
            if c:
                own[c] = path
    return own


def _v2_root() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            try:
                fstype = parts[parts.index("-") + 1]
            except (ValueError, IndexError):
                continue
            if fstype == "cgroup2":
                return parts[4]
    return None


def probe() -> tuple[str | None, str]:
    """Return ``(kind, detail)``: kind is ``"v2"``, ``"v1"`` or ``None`` (with the reason). Cached."""
    global _probe
    if _probe is not None:
        return _probe
    _probe = _do_probe()
    return _probe


def _do_probe() -> tuple[str | None, str]:
    if os.geteuid() != 0:
        return None, "not root (per-env cgroups need write access to the hierarchy)"
    try:
        own = _own_paths()
    except OSError as exc:
        return None, f"cannot read /proc/self/cgroup: {exc}"
    reasons = []
    v2 = _v2_root()
    if v2 is not None:
        parent = v2 + (own.get("<v2>", "/") if own.get("<v2>", "/") != "/" else "")
        try:
            with open(f"{parent}/cgroup.controllers") as f:
                ctrls = set(f.read().split())
        except OSError as exc:
            ctrls = set()
            reasons.append(f"v2: {exc}")
        if {"memory", "pids"} <= ctrls:
            try:
                test = _make_v2_parent(parent)
                return "v2", test
            except OSError as exc:
                reasons.append(f"v2 at {parent}: {exc}")
        else:
            reasons.append(f"v2 at {v2} has no memory+pids controllers")
    mem = os.path.join(_CG, "memory") + (own.get("memory", "/") if own.get("memory", "/") != "/" else "")
    pids = os.path.join(_CG, "pids") + (own.get("pids", "/") if own.get("pids", "/") != "/" else "")
    if os.path.isfile(f"{mem}/memory.limit_in_bytes") and os.path.isfile(f"{pids}/cgroup.procs"):
        name = f"boltzlabs-probe-{os.getpid()}-{secrets.token_hex(4)}"
        made = []
        try:
            for base in (mem, pids):
                os.mkdir(f"{base}/{name}")
                made.append(f"{base}/{name}")
            return "v1", f"{mem} + {pids}"
        except OSError as exc:
            reasons.append(f"v1: {exc}")
        finally:
            for p in made:
                try:
                    os.rmdir(p)
                except OSError:
                    pass
    else:
        reasons.append("no v1 memory+pids hierarchies")
    return None, "; ".join(reasons)


def _make_v2_parent(parent: str) -> str:
    """A process may not sit in a v2 group whose controllers are enabled for children (no internal
    processes rule), so per-env groups live under a sibling-free leaf ``boltzlabs`` of our group only
    when our own group can delegate; we simply enable the controllers in our group's subtree_control."""
    with open(f"{parent}/cgroup.subtree_control") as f:
        have = set(f.read().split())
    need = [c for c in ("memory", "pids") if c not in have]
    if need:
        write_text(f"{parent}/cgroup.subtree_control", " ".join("+" + c for c in need))
    return parent


class EnvCgroup:
    """The cgroup(s) of one env. Create in the parent, :meth:`join` in the child, :meth:`remove` at the end."""

    def __init__(self, kind: str, memory_bytes: int | None, pids: int | None, tag: str = "env"):
        self.kind = kind
        self._oom_kills_seen = 0
        # The pid says whose it is (a later worker sweeps a dead worker's); the token keeps a worker
        # that got a dead one's pid from colliding with what that one left behind.
        name = f"boltzlabs-{os.getpid()}-{tag}-{next(_counter)}-{secrets.token_hex(4)}"
        own = _own_paths()
        self.paths: list[str] = []
        try:
            if kind == "v2":
                v2 = _v2_root()
                if v2 is None:  # probe() found a cgroup2 mount for kind "v2"; it cannot just vanish
                    raise OSError("no cgroup2 mount in /proc/self/mountinfo")
                parent = v2 + (own.get("<v2>", "/") if own.get("<v2>", "/") != "/" else "")
                p = f"{parent}/{name}"
                os.mkdir(p)
                self.paths = [p]
                write_text(f"{p}/memory.max", memory_bytes if memory_bytes else "max")
                for fname, val in (("memory.swap.max", 0), ("memory.oom.group", 1)):
                    try:
                        write_text(f"{p}/{fname}", val)
                    except OSError:
                        pass
                write_text(f"{p}/pids.max", pids if pids else "max")
            else:
                mem = os.path.join(_CG, "memory") + (own.get("memory", "/") if own.get("memory", "/") != "/" else "")
                pid = os.path.join(_CG, "pids") + (own.get("pids", "/") if own.get("pids", "/") != "/" else "")
                pm, pp = f"{mem}/{name}", f"{pid}/{name}"
                os.mkdir(pm)
                self.paths.append(pm)
                os.mkdir(pp)
                self.paths.append(pp)
                if memory_bytes:
                    write_text(f"{pm}/memory.limit_in_bytes", int(memory_bytes))
                    try:  # no swap either (only where swap accounting is on)
                        write_text(f"{pm}/memory.memsw.limit_in_bytes", int(memory_bytes))
                    except OSError:
                        pass
                try:
                    write_text(f"{pm}/memory.swappiness", 0)
                except OSError:
                    pass
                if pids:
                    write_text(f"{pp}/pids.max", int(pids))
        except BaseException:
            self.remove()
            raise
        # the child writes into these after fork; open nothing here (fds would leak into other children)
        self.procs_files = [f"{p}/cgroup.procs" for p in self.paths]
        # v1: the single-threaded child moves itself through ``tasks``: migrating only the current
        # thread skips the global cgroup_threadgroup_rwsem write lock, whose RCU grace period made
        # a ``cgroup.procs`` write cost 7-27 ms here under load (``tasks``: ~0.1 ms).
        self.join_files = [f"{p}/tasks" if kind == "v1" else f"{p}/cgroup.procs" for p in self.paths]

    def join(self) -> None:
        """Move the calling, single-threaded process into the group (in the child, as root, first thing)."""
        for path in self.join_files:
            write_text(path, 0)

    def pids(self) -> list[int]:
        out: list[int] = []
        for path in self.procs_files:
            try:
                out.extend(int(x) for x in read_bytes(path).split())
            except OSError:
                pass
        return sorted(set(out))

    def signal_all(self) -> None:
        """One pass of SIGKILL over the group's processes (never waits)."""
        for p in self.pids():
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL everything in the group (cgroup.kill on v2; a bounded kill loop on v1)."""
        if not self.paths:
            return
        if self.kind == "v2" and os.path.exists(f"{self.paths[0]}/cgroup.kill"):
            try:
                write_text(f"{self.paths[0]}/cgroup.kill", 1)
                return
            except OSError:
                pass
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def memory_usage(self) -> int | None:
        """Bytes the group holds now (``None``: unreadable)."""
        name = "memory.current" if self.kind == "v2" else "memory.usage_in_bytes"
        try:
            with open(f"{self.paths[0]}/{name}") as f:
                return int(f.read())
        except (OSError, IndexError, ValueError):
            return None

    def set_memory_limit(self, limit: int | None) -> bool:
        """Set the group's memory limit (``None``: none); whether it took. A limit under what the
        group holds makes the kernel reclaim first (and fail if it cannot: ``False``)."""
        name = "memory.max" if self.kind == "v2" else "memory.limit_in_bytes"
        try:
            write_text(f"{self.paths[0]}/{name}", int(limit) if limit else ("max" if self.kind == "v2" else -1))
        except (OSError, IndexError):
            return False
        return True

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed something in this group (since :meth:`forget_oom_kills`)."""
        return self.oom_kills() > self._oom_kills_seen

    def oom_kills(self) -> int:
        """How many processes the kernel OOM-killed in this group (0 where unreadable)."""
        name, key = ("memory.events", "oom_kill") if self.kind == "v2" else ("memory.oom_control", "oom_kill")
        try:
            with open(f"{self.paths[0]}/{name}") as f:
                for line in f:
                    words = line.split()
                    if len(words) == 2 and words[0] == key:
                        return int(words[1])
        except (OSError, IndexError, ValueError):
            pass
        return 0

    def forget_oom_kills(self) -> None:
        """Count only later OOM kills in :meth:`oom_killed` (one in a call that lowered the limit
        for its program was that program's, not the env's)."""
        self._oom_kills_seen = self.oom_kills()

    def remove(self, timeout: float = 2.0) -> None:
        """Kill what is left and remove the group(s). Idempotent."""
        if not self.paths:
            return
        self.kill()
        deadline = time.monotonic() + timeout
        left = []
        for p in reversed(self.paths):
            while True:
                try:
                    os.rmdir(p)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        left.append(p)
                        break
                    self.kill()
                    time.sleep(0.005)
        self.paths = left

    def try_remove(self) -> bool:
        """One non-blocking attempt to remove the group(s), True when they are gone; where some
        process is left, one more pass of SIGKILL over them, for the next attempt. (``rmdir``
        first: a group whose processes are all gone needs no look at its members.)"""
        if self._rmdir_all():
            return True
        self.signal_all()
        return False

    def _rmdir_all(self) -> bool:
        left = []
        for path in self.paths:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                left.append(path)
        self.paths = left
        return not left


def env_cgroup(memory_bytes: int | None, pids: int | None, tag: str) -> EnvCgroup | None:
    """A new cgroup for one env's limits, or None where this host gives none (see :func:`probe`)."""
    kind = probe()[0]
    return EnvCgroup(kind, memory_bytes, pids, tag=tag) if kind is not None else None


class Graveyard:
    """Env cgroups whose processes were still exiting when their launcher let go of them: removed
    later, each time the launcher tries again (:meth:`retry`), so that no launch waits for an
    old env's namespace teardown."""

    def __init__(self) -> None:
        self.cgroups: list[EnvCgroup] = []

    def add(self, cgroup: EnvCgroup) -> None:
        """Remove ``cgroup`` at the next :meth:`retry`."""
        self.cgroups.append(cgroup)

    def bury(self, cgroup: EnvCgroup) -> None:
        """Remove ``cgroup`` now if it is empty already, else later."""
        if not cgroup.try_remove():
            self.cgroups.append(cgroup)

    def retry(self) -> None:
        """One more non-blocking attempt at each cgroup still here."""
        if self.cgroups:
            self.cgroups = [cg for cg in self.cgroups if not cg.try_remove()]

    def take_all(self) -> list[EnvCgroup]:
        """Every cgroup still here, handed over (the launcher is closing and removes them, waiting)."""
        cgroups, self.cgroups = self.cgroups, []
        return cgroups


def sweep_stale() -> list[str]:
    """Remove env cgroups left by workers that died without cleaning up (SIGKILL, crash).

    Names carry the creating worker's pid (``boltzlabs-<pid>-...``); a cgroup whose
    worker is gone is emptied (its processes killed) and removed. Returns what went.
    """
    import glob
    import signal as _signal

    removed = []
    v2 = _v2_root()
    roots = [os.path.join(_CG, c) for c in ("memory", "pids")] + ([v2] if v2 else [])
    for root in roots:
        for path in glob.glob(os.path.join(root, "**", "boltzlabs-*-*"), recursive=True):
            try:
                owner = int(os.path.basename(path).split("-")[1])
            except (IndexError, ValueError):
                continue
            if owner == os.getpid() or pid_alive(owner):
                continue
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        try:
                            os.kill(int(pid), _signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                for _ in range(100):
                    try:
                        os.rmdir(path)
                        removed.append(path)
                        break
                    except FileNotFoundError:
                        break  # another starting worker swept it first
                    except OSError:
                        time.sleep(0.01)
            except OSError:
                continue
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
