"""How a sandbox backend finds the mode it runs in on this host: by real launches, once per process.

Only an actual launch shows what a host allows (user namespaces, ``pivot_root``, cgroups, bwrap's
setuid or not), so each backend's ``available()`` and ``report()`` ask :func:`probed_mode`, which
runs the backend's probe the first time and remembers its answer for every instance with the same
settings; the probe tries the backend's modes best first (:func:`first_working_mode`), each by
starting ``python -S`` in a throwaway env dir (:func:`probe_launch`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Hashable, Sequence

from .base import ENV_UID_BASE, Launched, LaunchSpec, Limits, SandboxUnavailable

#: What each probe found, by backend and settings: ``(mode, detail)`` or ``(None, reason)``.
_PROBED: dict[Hashable, tuple[str | None, str]] = {}
_PROBED_LOCK = threading.Lock()


def probed_mode(key: Hashable, probe: Callable[[], tuple[str | None, str]]) -> tuple[str | None, str]:
    """What ``probe()`` finds, run once per process for ``key`` (a backend and its settings),
    whatever the instance that asks."""
    with _PROBED_LOCK:
        if key not in _PROBED:
            _PROBED[key] = probe()
        return _PROBED[key]


def working_mode(name: str, probed: tuple[str | None, str]) -> str:
    """The mode backend ``name`` found (``probed``: its :func:`probed_mode`), or :class:`SandboxUnavailable`."""
    mode, why = probed
    if mode is None:
        raise SandboxUnavailable(f"isolation={name!r} is not available on this host: {why}")
    return mode


def first_working_mode(
    modes: Sequence[str],
    launch: Callable[[LaunchSpec, str], Launched],
    *,
    works: str,
    failed: str = "{mode}: {why}",
    keep_failures: bool = False,
) -> tuple[str | None, str]:
    """Try ``modes`` best first, each by a real ``launch(spec, mode)``: the first that works and
    ``works`` (formatted with the launch's ``ms``; after the modes that failed, with
    ``keep_failures``), or ``None`` and why each failed (``failed``, formatted with ``mode`` and ``why``)."""
    reasons: list[str] = []
    for mode in modes:

        def launch_in_mode(spec: LaunchSpec, mode: str = mode) -> Launched:
            return launch(spec, mode)

        ok, why, setup_ms = probe_launch(launch_in_mode, uid=ENV_UID_BASE - 1)
        if ok:
            detail = works.format(ms=setup_ms)
            return mode, "; ".join([*reasons, detail]) if keep_failures else detail
        reasons.append(failed.format(mode=mode, why=why))
    return None, "; ".join(reasons)


def probe_launch(launch: Callable[[LaunchSpec], Launched], uid: int | None = None) -> tuple[bool, str, float]:
    """Start ``python -S -c 'stat /env'`` through ``launch(spec)`` in a throwaway env dir.

    Returns ``(ok, what went wrong, setup_ms)``: the cheap, real test every backend's
    ``available()`` runs, since only an actual launch shows what the host allows.
    """
    tmp = tempfile.mkdtemp(prefix="boltzlabs-probe-")
    env_dir, ws = os.path.join(tmp, "env"), os.path.join(tmp, "ws")
    os.mkdir(env_dir)
    os.mkdir(ws)
    for path in (tmp, env_dir):
        os.chmod(path, 0o755)
    r, w = os.pipe()
    try:
        spec = LaunchSpec(
            argv=[sys.executable, "-S", "-c", "import os; os.stat('/env')"],
            env_dir=env_dir,
            workspace=ws,
            stdin_fd=r,
            stdout_fd=w,
            stderr_fd=w,
            limits=Limits(memory_bytes=None),
            uid=uid,
        )
        launched = launch(spec)
        os.close(w)
        w = -1
        out = b""
        while True:  # read to EOF before waiting: a chatty failure must not fill the pipe
            chunk = os.read(r, 65536)
            if not chunk:
                break
            out += chunk
        _, status = os.waitpid(launched.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if launched.setup_error or code != 0:
            return (
                False,
                (launched.setup_error or out.decode("utf-8", "replace").strip() or f"probe exited with {code}"),
                launched.setup_ms,
            )
        return True, "", launched.setup_ms
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}", 0.0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        shutil.rmtree(tmp, ignore_errors=True)
