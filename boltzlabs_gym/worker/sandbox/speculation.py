"""Whether the kernel forces its speculation mitigations on the sandboxes' filtered processes.

Kernels before 5.16, and any kernel booted with ``spec_store_bypass_disable=seccomp``, force
Speculative Store Bypass Disable (and, with ``spectre_v2_user=seccomp``, STIBP) on every process
that installs a seccomp filter without ``SECCOMP_FILTER_FLAG_SPEC_ALLOW``, for the rest of its life.
CPU-bound code then runs up to about half as fast as in an unfiltered process. The ``namespaces``
backend installs its filters with the flag (:func:`boltzlabs_gym.envside.syscalls.seccomp_set_filter`);
bubblewrap installs the ``bwrap`` backend's filter without it. Whether this kernel forces them
shows in its ``spec_store_bypass`` report, which ends ``... via prctl and seccomp`` where it does.

>>> speculation_property("Mitigation: Speculative Store Bypass disabled via prctl", passes_flag=False)
('not forced (kernel: Mitigation: Speculative Store Bypass disabled via prctl)', None)
>>> speculation_property("Mitigation: Speculative Store Bypass disabled via prctl and seccomp", True, (5, 4))[0]
'not forced: filters installed with SECCOMP_FILTER_FLAG_SPEC_ALLOW'
"""

from __future__ import annotations

import logging
import os

__all__ = ["SSB_REPORT", "kernel_release", "kernel_ssb_report", "report_speculation", "speculation_property"]

log = logging.getLogger("boltzlabs_gym.sandbox")
_warned: set[str] = set()

#: The kernel's report of its Speculative Store Bypass mitigation.
SSB_REPORT = "/sys/devices/system/cpu/vulnerabilities/spec_store_bypass"
#: The first kernel that knows ``SECCOMP_FILTER_FLAG_SPEC_ALLOW``.
SPEC_ALLOW_SINCE = (4, 17)


def kernel_ssb_report(path: str = SSB_REPORT) -> str | None:
    """The kernel's ``spec_store_bypass`` line, or None where it has none (not Linux, an old kernel)."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def kernel_release() -> tuple[int, int]:
    """This kernel's ``(major, minor)`` version; ``(0, 0)`` where it cannot be read."""
    parts = os.uname().release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


def speculation_property(
    report: str | None, passes_flag: bool, release: tuple[int, int] | None = None
) -> tuple[str, str | None]:
    """A sandbox report's ``speculation`` property, and a warning where the kernel forces the
    mitigations on the envs (None otherwise). ``passes_flag``: whether the backend installs its
    filters with ``SECCOMP_FILTER_FLAG_SPEC_ALLOW``; ``release`` the kernel's (read when None)."""
    if report is None or "seccomp" not in report:
        return f"not forced (kernel: {report or 'no spec_store_bypass report'})", None
    release = kernel_release() if release is None else release
    if passes_flag and release >= SPEC_ALLOW_SINCE:
        return "not forced: filters installed with SECCOMP_FILTER_FLAG_SPEC_ALLOW", None
    why = (
        "bubblewrap installs the filter without SECCOMP_FILTER_FLAG_SPEC_ALLOW"
        if not passes_flag
        else f"kernel {release[0]}.{release[1]} predates SECCOMP_FILTER_FLAG_SPEC_ALLOW (4.17)"
    )
    warning = (
        f"this kernel forces its speculation mitigations on every process with a seccomp filter ({report}), "
        f"and {why}: CPU-bound envs run up to about half as fast as unsandboxed. Use isolation='namespaces' "
        "on a kernel of 4.17 or later, or boot with spec_store_bypass_disable=prctl spectre_v2_user=prctl"
    )
    return f"forced on every env ({why})", warning


def report_speculation(props: dict, notes: list[str], passes_flag: bool) -> None:
    """Add the ``speculation`` property to a sandbox report's ``props`` and, where the kernel forces
    the mitigations on the envs, its warning to ``notes`` and (once per process) to the log."""
    props["speculation"], warning = speculation_property(kernel_ssb_report(), passes_flag)
    if warning is not None:
        notes.append(warning)
        if warning not in _warned:
            _warned.add(warning)
            log.warning("isolation: %s", warning)
