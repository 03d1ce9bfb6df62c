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


def tree_pss(pid: int, children: bool = True) -> int:
    """PSS in bytes of ``pid`` and (by default) all its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root] + (root.children(recursive=True) if children else [])
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0
    return sum(process_pss(p) for p in procs)
