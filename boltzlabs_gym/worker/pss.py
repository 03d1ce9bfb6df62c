"""Memory accounting: proportional set size (PSS) of whole process trees.

PSS splits each shared page between the processes that map it, so interpreter and
library pages shared by many envs are counted once in total, not once per env:
the honest figure for "how many envs fit in a GiB".
"""

from __future__ import annotations

import psutil


def process_pss(proc: psutil.Process) -> int:
    """PSS in bytes of one process (0 if it vanished or cannot be read)."""
    try:
        return int(proc.memory_full_info().pss)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, AttributeError):
        return 0


def trees_pss(pids: list[int]) -> list[int]:
    """PSS in bytes of each ``pid``'s whole tree (0 for a pid that is 0 or gone), from one pass over
    the process table (walking each root's children with psutil scans every process once per
    root, which made a ``status`` of a few hundred envs take seconds)."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info.get("ppid")
        if ppid:
            children.setdefault(ppid, []).append(proc.pid)
    out = []
    for pid in pids:
        total, stack = 0, [pid] if pid else []
        while stack:
            current = stack.pop()
            try:
                total += process_pss(psutil.Process(current))
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
            stack.extend(children.get(current, ()))
        out.append(total)
    return out


def pid_pss(pid: int) -> int:
    """PSS in bytes of the one process ``pid``, without its children (0 if it is gone); a
    process tree's is :func:`trees_pss`."""
    try:
        return process_pss(psutil.Process(pid))
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0
