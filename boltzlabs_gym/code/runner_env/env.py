"""The code runner's env: runs one program per step inside its sandbox and reports what it did.

Served by :class:`boltzlabs_gym.code.CodeRunner` in ``mode="boltz"``: the template imports this
file (and the modules programs commonly use) once, every env is forked from it, and the runner
hard-resets an env after every program, so each program starts in a sandbox no earlier program
touched. Standard library only (it runs inside the sandbox).

A step's action is a JSON object (built by :func:`boltzlabs_gym.code.runs.RunRequest.to_action`)::

    {"language": "python", "code": "...", "stdin": "...", "files": {"a.txt": "<base64>"},
     "fetch_files": ["out.txt"], "run_timeout": 10, "compile_timeout": 10,
     "memory_limit_mb": -1, "max_output_bytes": 1048576}

and its observation is ``{"compile_result": ..., "run_result": ..., "files": {...}}``, each result
``{"status", "execution_time", "return_code", "stdout", "stderr", "truncated"}`` (status
``Finished``, ``Error`` or ``TimeLimitExceeded``).

File paths (``files``, ``fetch_files``) are SandboxFusion's: relative ones in the workspace, and,
where the env is PID 1 of its own namespaces, absolute ones in the sandbox's private writable places
(``/mnt``, ``/data``, ``/home``, ``/tmp``, ``/dev/shm``: :data:`_wipe.ROOTS`), which the wipe or the
hard reset empties after every program. Any other path (``/etc/x``, ``/usr/x``, ``/mnt/../etc/x``,
``/env/x``), and any absolute one on the ``process`` backend (whose places would be the host's),
fails the run with a ``SandboxError`` naming it; a fetched file reached by a symlink that leads out
of those places is left out.

Python programs run in a child forked from a warm interpreter (a fresh ``__main__``, the
program's own stdin/stdout/stderr, ``random`` reseeded): where the env can be wiped, from its
zygote (``_zygote``: forked before the first request, so no request ever passed through its
memory), else from this env process; bash, C++ (``g++``) and Node.js programs run as
subprocesses. Every program runs in its own session (process group) in the workspace directory;
on its deadline the whole group is killed. Then, where the env is PID 1 of its own PID namespace,
the wipe (``_wipe``) kills every process left, empties the writable places and checks that
nothing is left; the observation's ``clean`` says whether it did, and the runner hard-resets an
env that is not clean. Without the wipe (``options["fresh"]``), every program, of any language,
runs in namespaces and places made for it alone (``_fresh``), and nothing is wiped.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (signal without its enum wrappers, as _zygote)
import atexit  # (here, as every module a program's path uses: a first import in a program copies ~70 pages)
import base64
import collections  # noqa: F401  (pre-imported: programs forked from the template find it warm)
import errno
import functools
import heapq  # noqa: F401
import itertools  # noqa: F401
import json  # noqa: F401
import math  # noqa: F401
import os
import random  # noqa: F401  (imported before any fork: its at-fork hook reseeds every program)
import re  # noqa: F401
import resource
import select
import signal
import stat
import string  # noqa: F401
import sys
import threading
import time
import types
import typing  # noqa: F401
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import _fresh  # type: ignore[import-not-found]  # (siblings: the env dir is on sys.path)
import _languages  # type: ignore[import-not-found]
import _recursion  # type: ignore[import-not-found]
import _warm  # type: ignore[import-not-found]
import _wipe  # type: ignore[import-not-found]
from _zygote import Zygote, ZygoteGone  # type: ignore[import-not-found]

from boltzlabs_gym.env import serve
from boltzlabs_gym.envside import fork_hooks, seccomp
from boltzlabs_gym.envside import syscalls as L
from boltzlabs_gym.envside.confine import SANDBOX_WORKSPACE, mount_points
from boltzlabs_gym.envside.process_setup import workspace_now

#: Programs' environment: nothing of the env process's own (its variables name the worker's paths).
PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "",
}
FINISHED, ERROR, TIMEOUT = "Finished", "Error", "TimeLimitExceeded"
#: Languages run in a child of a warm zygote as ``{python} -m <module>`` (pytest)
WARM = tuple(name for name, language in _languages.LANGUAGES.items() if language.warm)
#: The languages a zygote forks programs of: a program's kind, as the zygote is told it, is its index
KINDS = ("python", *WARM)
#: The code runtime programs see (``boltzlabs-gym code-runtime install``): Node.js packages, a Python venv.
RUNTIME = os.environ.get("BOLTZLABS_CODE_RUNTIME") or _languages.DEFAULT_RUNTIME
#: stdin and compiled binaries, outside the workspace where the env has a /tmp of its own (PID 1 of its
#: own namespaces); on the ``process`` backend envs share the host's /tmp, so each keeps them in its
#: own workspace, which the worker wipes with it (:func:`scratch_dir`)
SCRATCH = "/tmp/.boltzlabs_runner"
STDIN_PATH = os.path.join(SCRATCH, "stdin")


def has_private_places() -> bool:
    """Whether this env has writable places of its own (``/tmp``, ``/mnt``... :data:`_wipe.ROOTS`):
    where it is PID 1 of its own namespaces (or, in a program's fresh namespaces, the process that
    made them); on the ``process`` backend they are the host's."""
    return os.getpid() == 1 or _Fresh.in_program_namespaces


def scratch_dir(workspace: str) -> str:
    """Where this env keeps a program's stdin and binary: :data:`SCRATCH`, or in its workspace."""
    return SCRATCH if has_private_places() else os.path.join(workspace, ".boltzlabs_runner")


class _Wiping:
    """This env's wipe between programs: its zygote, the baseline, the programs' extra filter."""

    zygote: Zygote | None = None
    #: warm zygotes (:data:`KINDS` kind -> zygote), forked by the zygote at a kind's first program
    warm: dict[int, Zygote] = {}
    #: kind -> why it has no warm zygote here (its programs then start the interpreter)
    not_warm: dict[int, str] = {}
    baseline: _wipe.Baseline | None = None
    #: why programs are not wiped away here (each is then followed by a hard reset), or None
    unavailable: str | None = None
    #: the workspace, as the zygote found it (its programs' environment has no BOLTZLABS_WORKSPACE)
    workspace = ""
    #: stacked on every program where the env is wiped: POSIX message queues cannot be listed
    #: (no mqueue mount), so they cannot be wiped; programs cannot make one
    child_filter = None


#: How a step's ``unclean`` starts where a Python program could not run in fresh namespaces
NO_FRESH = "no fresh namespaces for this env's programs"


class _Fresh:
    """This env's programs in namespaces of their own (``options["fresh"]``, :mod:`_fresh`)."""

    zygote: Zygote | None = None
    #: warm zygotes (:data:`KINDS` kind -> zygote), forked by the zygote at a kind's first program:
    #: in its user namespace, they clone P for that kind's programs (see :func:`_fresh_zygote_for`)
    warm: dict[int, Zygote] = {}
    #: kind -> why it has no warm zygote here (its programs then run with their toolchain)
    not_warm: dict[int, str] = {}
    #: why programs cannot run in fresh namespaces here (each is then followed by a hard reset)
    unavailable: str | None = None
    cap_last = 0
    tmpfs_bytes = 0
    program_filter = None  # (built once, in the zygote)
    calibration: int | None = None  # (the levels the zygote hides below programs: see _recursion)
    sockets = 0  # the unix sockets of the sandbox's network namespace before any program
    points: list[str] = []  # the sandbox's mount points (read once, in the zygote)
    #: set in the process that makes a program's namespaces (P): the places it sees are the program's
    in_program_namespaces = False
    #: P's signal mask before it blocked every signal: what the commands it starts get back
    unblocked: tuple = ()
    wanted = False  # (the runner asked for it: ``options["fresh"]``)


def reset(seed, options=None):
    """Ready the env; where the runner wipes (``options["wipe"]``, the default), also the zygote and
    the wipe's baseline. Without the wipe, where the runner asks for ``fresh`` namespaces, a zygote
    in a user namespace of its own forks each Python program into namespaces made for it
    (:mod:`_fresh`); else each env runs one program and is killed after it: its programs fork from
    the env itself, which has seen no other request."""
    options = options or {}
    wanted = options.get("wipe", True)
    if wanted and _Wiping.zygote is None and _Wiping.unavailable is None:
        _Wiping.unavailable = _wipe.unavailable() or _start_wiping()
    elif not wanted and options.get("fresh") and _Fresh.zygote is None and _Fresh.unavailable is None:
        # now, before any request (the zygote must never hold one), also in an env forked afresh after
        # a hard reset; and at start-up the runner hears why where it cannot work
        _Fresh.wanted = True
        _Fresh.unavailable = _wipe.unavailable() or _start_fresh(options.get("fresh_calibration"))
        if _wipe.unavailable() is None:  # (a sandbox of its own, which may let it make user namespaces)
            _forbid_user_namespaces()
    ready = {"ready": True, "wipe": _Wiping.zygote is not None, "no_wipe": _Wiping.unavailable}
    if options.get("fresh"):
        ready["fresh"], ready["no_fresh"] = _Fresh.unavailable is None, _Fresh.unavailable
        ready["fresh_calibration"] = _Fresh.calibration
    if options.get("languages"):  # (asked at start-up only: not on every hard reset)
        ready["languages"] = _languages.availability(RUNTIME)
    return ready


def _start_wiping() -> str | None:
    """Before the first request: the programs' filter, the env protected, the zygote, the baseline,
    and one wipe of the sandbox as it is, so that a wipe that cannot work here says so now (and
    why) rather than after every program. ``None``, or why programs are not wiped here."""
    zygote = None
    try:
        _Wiping.child_filter = seccomp.build_filter(deny=("mq_open",))
        _wipe.protect()
        zygote = Zygote(_zygote_program, prepare=_zygote_prepare, warm=_zygote_warm, adjust=_recursion.hide)
        _calibrate_recursion(zygote, 0)
        baseline = _wipe.record([zygote.pid])
        trial = _wipe.wipe(baseline, [zygote.pid])
        if trial is not None:
            raise RuntimeError(f"a wipe of the fresh sandbox failed: {trial}")
    except Exception as exc:  # no wipe: every program is followed by a hard reset
        if zygote is not None:
            zygote.close()
        return f"{type(exc).__name__}: {exc}"
    _Wiping.zygote, _Wiping.baseline = zygote, baseline
    return None


def _start_fresh(calibration: object = None) -> str | None:
    """Before the first request: the zygote in its own user namespace, and a trial program forked
    into fresh namespaces (the recursion probe: its depth calibrates the zygote), so that where they
    cannot be made this says so now, and why. ``None``, or why programs are hard-reset here instead.

    ``calibration``: what an earlier env's trial found (the runner passes it on to an env forked
    after a hard reset, an integer): that env's zygote takes it instead of running a trial (about 4
    ms of CPU that every other language's program would pay); its answer still shows it lives."""
    zygote = None
    try:
        if workspace_now() != SANDBOX_WORKSPACE:
            raise RuntimeError(f"the workspace is {workspace_now()}, not {SANDBOX_WORKSPACE}")
        _check_carried_mounts()
        _wipe.protect()
        _Fresh.tmpfs_bytes = _tmpfs_bytes()
        zygote = Zygote(
            _fresh_program,
            prepare=_fresh_zygote_prepare,
            warm=_zygote_warm,
            adjust=_recursion.hide,
            fork=_fresh.fork_program_init,
        )
        _Fresh.sockets = _fresh.unix_sockets()  # (the env's own: its socket pair with the zygote)
        if type(calibration) is int and calibration >= 0:
            zygote.adjust(calibration)  # (ZygoteGone where its user namespace could not be made)
            hidden: int | None = calibration
        else:
            result = _probe_fresh(zygote, 0)
            if result["return_code"] != 0 or not result.get("fresh"):
                raise RuntimeError(f"a trial program in fresh namespaces failed: {result['stderr'].strip() or result}")
            hidden = _levels_to_hide({"depth": int(result["stdout"])}, 0)
            if hidden is not None:
                zygote.adjust(hidden)
        _Fresh.calibration = hidden
    except Exception as exc:
        if zygote is not None:
            zygote.close()
        return f"{type(exc).__name__}: {exc}"
    _Fresh.zygote = zygote
    return None


def _forbid_user_namespaces() -> None:
    """Once the zygote is forked (or could not be): no user namespace for this env or anything it
    forks from now on (its toolchain programs, a Python program forked from the env where there
    is no zygote). The session lets its envs make them (``nested_user_namespaces``) for the zygote
    alone; the programs' own filter refuses them again below it."""
    prog = seccomp.build_filter(deny=(), unshare_deny_flags=L.CLONE_NEWUSER)
    if prog is not None:
        seccomp.install(prog)


def _check_carried_mounts() -> None:
    """The mounts inside the places a program gets afresh are carried over onto its own (an
    interpreter's tree under /tmp, say): each must be read-only, or it would outlive the program."""
    for point in _wipe.mounts_below(_wipe.ROOTS):
        if not os.statvfs(point).f_flag & os.ST_RDONLY:
            raise RuntimeError(f"{point} is a writable mount inside a program's places: it would outlive the program")


def _tmpfs_bytes() -> int:
    """The size of each fresh place: that of the sandbox's own /tmp."""
    st = os.statvfs("/tmp")
    return st.f_blocks * st.f_frsize


def step(action):
    fresh = _Fresh.zygote is not None  # (every language: Python forked by P, the others run by it)
    try:
        result = run_program(action, fresh)
    except Exception as exc:  # the runner's own failure, not the program's: SandboxError upstream
        result = {"compile_result": None, "run_result": _error(f"{type(exc).__name__}: {exc}"), "files": {}}
    ran_fresh = bool(result.pop("fresh", False))
    result["clean"], result["unclean"] = False, "not wiped (hard reset)"
    if fresh:
        # nothing of the program outlived it; the env is clean where it ran it that way and its zygotes live
        alive = _Fresh.zygote is not None and all(z.alive() for z in (_Fresh.zygote, *_Fresh.warm.values()))
        result["clean"] = ran_fresh and alive
        result["fresh"] = result["clean"]
        result["unclean"] = None if result["clean"] else ("the zygote died" if not alive else "fresh namespaces failed")
    elif _Fresh.wanted and _Fresh.unavailable is not None:
        result["unclean"] = f"{NO_FRESH}: {_Fresh.unavailable}"  # (the runner warns once)
    if action.get("wipe", True) and _Wiping.zygote is not None and _Wiping.baseline is not None:
        zygotes = [_Wiping.zygote, *_Wiping.warm.values()]
        reason = _wipe.wipe(_Wiping.baseline, [z.pid for z in zygotes])
        if reason is None and not all(z.alive() for z in zygotes):
            reason = "a zygote died"
        result["clean"], result["unclean"] = reason is None, reason
    return result, 0.0, True, {}


def _error(message: str) -> dict:
    return {"status": ERROR, "execution_time": None, "return_code": None, "stdout": None, "stderr": message}


def run_program(action: dict, fresh: bool = False) -> dict:
    """Run ``action``'s program in the workspace (``fresh``: in namespaces of its own, :mod:`_fresh`);
    its compile and run results and fetched files."""
    workspace = workspace_now()
    if fresh:
        return _run_program_fresh(action, workspace)
    scratch = scratch_dir(workspace)
    os.makedirs(scratch, exist_ok=True)
    for name in action.get("fetch_files") or []:  # a name it may never fetch fails the run before it runs
        _file_path(workspace, name)
    _write_files(workspace, action.get("files") or {})
    language = action["language"]
    cap = int(action.get("max_output_bytes", 1 << 20))
    memory_mb = int(action.get("memory_limit_mb", -1))
    stdin_path = os.path.join(scratch, "stdin")
    with open(stdin_path, "wb") as f:
        f.write((action.get("stdin") or "").encode("utf-8", "surrogateescape"))
    zygote = _zygote_for(language)
    if language == "python" or zygote is not None:
        kind = KINDS.index(language)
        n, src = _source_path(workspace, _numbered_suffix(_languages.LANGUAGES[language].source), action["code"])
        if zygote is not None:
            started = _from_zygote(zygote, n, memory_mb, kind)
        else:
            started = _fork_python(_program_argv(kind, src), workspace, stdin_path, memory_mb)
        compile_result, run_result = None, _supervise(started, action["run_timeout"], cap)
    else:
        compile_result, run_result = _run_toolchain(language, action, workspace, scratch, stdin_path)
    return {"compile_result": compile_result, "run_result": run_result, "files": _fetch(workspace, action)}


#: language -> why it cannot run here (None: it can), found once per env at its first program
_missing: dict[str, str | None] = {}


def _why_not(language: str) -> str | None:
    """Why ``language`` cannot run in this sandbox (its toolchain or runtime is missing), or None."""
    if language not in _missing:
        spec = _languages.LANGUAGES.get(language)
        if spec is None:
            why = _languages.NOT_SERVED.get(language, "SandboxFusion has no such language")
            _missing[language] = f"language {language!r} is not served here: {why}"
        else:
            why = spec.why_not(_languages.PATH, RUNTIME)
            _missing[language] = None if why is None else f"language {language!r} cannot run here: {why}"
    return _missing[language]


def _run_toolchain(language: str, action: dict, workspace: str, scratch: str, stdin_path: str) -> tuple:
    """Compile (where the language does) and run a program with its toolchain; the two results."""
    why = _why_not(_languages.ALIASES.get(language, language))
    if why is not None:
        return None, _error(why)
    spec = _languages.LANGUAGES[_languages.ALIASES.get(language, language)]
    code = spec.rewrite(action["code"]) if spec.rewrite else action["code"]
    main = spec.main_of(code)
    if spec.find_main and main is None:  # SandboxFusion's answer to a Scala program without an object
        return {**_error("Object name not found."), "return_code": 1}, None
    names = _placeholders(spec, action, workspace, scratch, main or "Main")
    names["src"] = _write_source(workspace, spec.source, code, main)
    _write_support(spec, names)
    env = dict(PROGRAM_ENV, HOME=workspace, **{k: v.format(**names) for k, v in spec.env.items()})
    cap = int(action.get("max_output_bytes", 1 << 20))
    memory_mb = int(action.get("memory_limit_mb", -1))
    data_only = spec.reserves_address_space
    compile_result = None
    if spec.compile is not None:
        cmd = [part.format(**names) for part in spec.compile]
        started = _spawn(cmd, workspace, os.devnull, memory_mb, env, data_only)
        compile_result = _supervise(started, action.get("compile_timeout", 10), cap)
        if compile_result["status"] != FINISHED or compile_result["return_code"] != 0:
            return compile_result, None
    cmd = [part.format(**names) for part in spec.run]
    started = _spawn(cmd, workspace, stdin_path, memory_mb, env, data_only)
    return compile_result, _supervise(started, action["run_timeout"], cap)


def _placeholders(spec, action: dict, workspace: str, scratch: str, main: str) -> dict:
    """The values of a language's command placeholders for this program (see ``_languages``)."""
    files = action.get("files") or {}
    brought = [os.path.join(workspace, n) for n in files if n.endswith(".jar") and not os.path.isabs(n)]
    # (sys.executable: the code runtime's, where the runner found one: CodeRunner's python)
    return spec.placeholders(workspace, scratch, RUNTIME, sys.executable, main, brought)


def _write_support(spec, names: dict) -> None:
    """Write the files a language's toolchain reads beside the program (C#'s assert listener, say)."""
    for path, text in spec.support.items():
        with open(path.format(**names), "w", encoding="utf-8") as f:
            f.write(text)


def _write_source(workspace: str, pattern: str, code: str, main: str | None) -> str:
    """Write the program where its language wants it: ``main<n>.<ext>`` (``n`` avoiding a file the
    request brought), or a fixed name (``Main.java``, ``<class>.java``, ``Program.cs``)."""
    if "{n}" in pattern:
        return _source_path(workspace, _numbered_suffix(pattern), code)[1]
    path = os.path.join(workspace, pattern.format(main=main))
    with open(path, "wb") as f:
        f.write(code.encode("utf-8", "surrogateescape"))
    return path


def _write_files(workspace: str, files: dict, stage: bool = False) -> list[str]:
    """Write the request's files (name -> base64), each where :func:`_file_path` puts it (``stage``:
    where the env stages it for a program in fresh namespaces, :func:`_fresh.staged`); a
    ``ValueError`` naming the first that cannot be written (the run is then a SandboxError). The
    paths written, as programs see them."""
    written = []
    for name, content in files.items():
        if not isinstance(content, str):
            continue  # SandboxFusion skips files given as null
        seen = _file_path(workspace, name) if stage else _resolved(workspace, name)
        path = _fresh.staged(seen) if stage else seen
        written.append(seen)
        try:
            fd = _open_walking(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_dirs=True)
        except OSError as exc:  # a read-only tree in a writable place (a venv under /home), a directory...
            raise ValueError(f"file path {name!r} cannot be written: {exc.strerror}") from None
        with open(fd, "wb") as f:
            f.write(base64.b64decode(content))
    return list(dict.fromkeys(written))


def _fetch(workspace: str, action: dict) -> dict:
    """The requested files that are regular files in the writable places after the program (name ->
    base64); a name that is missing, not a regular file, or reached by a symlink that leaves those
    places is left out, as SandboxFusion leaves out a missing file."""
    files = {}
    for name in action.get("fetch_files") or []:
        try:
            fd = _open_walking(_resolved(workspace, name), os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO: no wait)
        except (ValueError, OSError):
            continue
        with open(fd, "rb") as f:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                files[name] = base64.b64encode(f.read(int(action.get("max_file_bytes", 16 << 20)))).decode()
    return files


def _file_path(workspace: str, name: str) -> str:
    """Where the request's file ``name`` is, as SandboxFusion takes it: a relative name in the
    workspace, an absolute one (``/mnt/data/x.csv``) as it is; ``..`` resolved by name. A
    ``ValueError`` naming the path and what is allowed unless it lies strictly inside the
    workspace or one of the sandbox's private writable places (:data:`_wipe.ROOTS`, which the wipe
    empties after every program): never over the toolchains, the system or the env's own code."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"file path {name!r} is not a path")
    if not os.path.isabs(name):
        path = os.path.normpath(os.path.join(workspace, name))
        if _place_of(path, [workspace]) is None:
            raise ValueError(f"file path {name!r} leaves the workspace ({workspace}); {_ALLOWED}")
        return path
    if not has_private_places():
        raise ValueError(
            f"file path {name!r} is absolute, and this env has no private places for it: it is not PID 1 "
            "of its own namespaces (the process isolation backend), so it would be the host's; only paths "
            "relative to the workspace are allowed here (the namespaces backend takes absolute ones)"
        )
    path = os.path.normpath(name)
    if _place_of(path, _wipe.ROOTS) is None:
        raise ValueError(f"file path {name!r} is outside the places a program may write; {_ALLOWED}")
    return path


_ALLOWED = f"allowed: paths relative to the workspace, and absolute ones inside {', '.join(_wipe.ROOTS)}"


def _place_of(path: str, places: Iterable[str]) -> str | None:
    """The place of ``places`` that ``path`` lies strictly inside (a file over a place itself: none)."""
    return next((p for p in places if path.startswith(p.rstrip(os.sep) + os.sep)), None)


def _resolved(workspace: str, name: str) -> str:
    """:func:`_file_path` with its symlinks resolved (a program may have left some for the fetch): a
    ``ValueError`` where they lead out of the places it may write."""
    path = _file_path(workspace, name)
    real = os.path.realpath(path)
    # (in a namespaces sandbox the places are mount points, never symlinks; a host workspace may not be)
    places = _wipe.ROOTS if has_private_places() else [os.path.realpath(workspace)]
    if _place_of(real, places) is None:
        raise ValueError(f"file path {name!r} leads to {real!r}, outside the places a program may write; {_ALLOWED}")
    return real


def _open_walking(path: str, flags: int, make_dirs: bool = False) -> int:
    """Open ``path`` (absolute, its symlinks resolved) one component at a time from ``/``, following
    no symlink: one a program's daemon swapped in since :func:`_resolved` looked fails the open
    (``ELOOP``/``ENOTDIR``) instead of leading out. ``make_dirs``: make the missing directories."""
    *dirs, last = [part for part in path.split(os.sep) if part]
    fd = os.open(os.sep, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in dirs:
            parent, fd = fd, -1
            try:
                fd = _into_directory(parent, part, make_dirs)
            finally:
                os.close(parent)
        return os.open(last, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
    finally:
        if fd >= 0:
            os.close(fd)


def _into_directory(parent: int, name: str, make: bool) -> int:
    """An ``O_PATH`` fd of the directory ``name`` in ``parent`` (made if missing and ``make``); an
    ``OSError`` where it is anything else, a symlink included (``O_NOFOLLOW`` opens the link itself)."""
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=parent)
    except FileNotFoundError:
        if not make:
            raise
        os.mkdir(name, 0o777, dir_fd=parent)
        fd = os.open(name, flags, dir_fd=parent)
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotADirectoryError(errno.ENOTDIR, "not a directory (or a symlink)", name)
    return fd


def _numbered_suffix(pattern: str) -> str:
    """What follows the number in a numbered source file name (``main{n}_test.py``: ``_test.py``)."""
    return pattern.split("{n}", 1)[1]


def _source_path(workspace: str, suffix: str, code: str, stage: bool = False) -> tuple[int, str]:
    """Write ``code`` to ``main<suffix>`` (``main<n><suffix>`` if the request brought that name); ``(n, path)``.
    ``stage``: staged for a program in fresh namespaces (:func:`_fresh.staged`)."""
    n = 0
    where = _fresh.staged if stage else str
    while os.path.exists(where(path := _main_path(workspace, n, suffix))):  # a file the request brought
        n += 1
    target = where(path)
    if stage:
        os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as f:
        f.write(code.encode("utf-8", "surrogateescape"))
    return n, path


def _main_path(workspace: str, n: int, suffix: str) -> str:
    return os.path.join(workspace, f"main{n or ''}{suffix}")


# ------------------------------------------------------------------------------ starting programs
def _pipes() -> tuple[int, int, int, int]:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return out_r, out_w, err_r, err_w


@dataclass
class _Started:
    """A program that runs: its pid (and process group), a pidfd, the read ends of its stdout and
    stderr, and how to get its wait status once it has ended (``None``: unknown)."""

    pid: int
    pidfd: int
    out_r: int
    err_r: int
    reap: Callable[[], int | None]


def _enter_child(
    workspace: str, stdin_path: str, memory_mb: int, out_w: int, err_w: int, data_only: bool = False
) -> None:
    """In the forked child: its own session, the memory limit, stdio, cwd; every other fd closed."""
    _own_session(memory_mb, data_only)
    if _Fresh.in_program_namespaces:  # (P blocks every signal: the command gets the mask P had)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, _Fresh.unblocked)
    os.umask(0o022)
    _wire_stdio(stdin_path, out_w, err_w)
    os.chdir(workspace)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if _Wiping.child_filter is not None:
        seccomp.install(_Wiping.child_filter)


def _own_session(memory_mb: int, data_only: bool = False) -> None:
    """A program's own session (process group), its own /proc files, its memory limit: on its
    address space and data segment, or (``data_only``: runtimes that reserve far more address
    space than they use, JVMs, Go, V8, Mono) on its data segment alone, which counts the memory
    they commit (private writable mappings) and not what they only reserve."""
    os.setsid()
    _wipe.set_dumpable(True)  # (the env is not, where it is wiped): the program's own /proc/<pid> are its own
    if memory_mb > 0:
        limit = memory_mb << 20
        for which in (resource.RLIMIT_DATA,) if data_only else (resource.RLIMIT_AS, resource.RLIMIT_DATA):
            _, hard = resource.getrlimit(which)
            resource.setrlimit(which, (limit, hard))


def _wire_stdio(stdin_path: str, out_w: int, err_w: int) -> None:
    """The program's stdin from its file, stdout and stderr to its pipes; every other fd closed."""
    fd = os.open(stdin_path, os.O_RDONLY)
    os.dup2(fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, 65536)


def _spawn(
    cmd: list[str], workspace: str, stdin_path: str, memory_mb: int, env: dict, data_only: bool = False
) -> _Started:
    """Fork and exec ``cmd`` with environment ``env``; its pid and the read ends of its stdout and stderr."""
    out_r, out_w, err_r, err_w = _pipes()
    pid = _fork()
    if pid == 0:
        try:
            _enter_child(workspace, stdin_path, memory_mb, out_w, err_w, data_only)
            os.execvpe(cmd[0], cmd, env)
        except BaseException as exc:
            os.write(2, f"cannot run {cmd[0]}: {exc}\n".encode())
        os._exit(127)
    os.close(out_w)
    os.close(err_w)
    return _child_started(pid, out_r, err_r)


def _fork() -> int:
    """``os.fork()`` from this env, without the thread bookkeeping of the standard library's
    at-fork hooks where the env has one thread (:mod:`~boltzlabs_gym.envside.fork_hooks`)."""
    fork_hooks.suspend()
    try:
        pid = os.fork()
    finally:
        fork_hooks.restore()  # (the child's first act too: its own forks run the hooks)
    return pid


def _child_started(pid: int, out_r: int, err_r: int) -> _Started:
    return _Started(pid, os.pidfd_open(pid), out_r, err_r, lambda: os.waitpid(pid, 0)[1])


def _program_argv(kind: int, src: str) -> list[str]:
    """What a program of ``kind`` runs, as ``python``'s arguments: ``[src]`` (a Python script), or
    ``["-m", module, *args]`` (a warm language's)."""
    if KINDS[kind] == "python":
        return [src]
    module, args = _languages.LANGUAGES[KINDS[kind]].warm_module()
    return ["-m", module, *(arg.format(src=src) for arg in args)]


def _fork_python(argv: list[str], workspace: str, stdin_path: str, memory_mb: int) -> _Started:
    """Fork this warm interpreter and run ``python <argv>`` in the child as the interpreter would."""
    out_r, out_w, err_r, err_w = _pipes()
    pid = _fork()
    if pid == 0:
        code = 1
        try:
            _enter_child(workspace, stdin_path, memory_mb, out_w, err_w)
            code = _run_python_here(argv, workspace)
        except BaseException:
            pass
        os._exit(code)
    os.close(out_w)
    os.close(err_w)
    return _child_started(pid, out_r, err_r)


def _zygote_for(language: str) -> Zygote | None:
    """The zygote that forks ``language``'s programs: the zygote for Python, a warm one (forked at
    the language's first program, :data:`WARM`) for pytest; None where there is none (no wipe: the
    env forks Python programs itself; a warm language then starts the interpreter)."""
    if _Wiping.zygote is None or language == "python":
        return _Wiping.zygote
    if language not in WARM or _why_not(language) is not None:
        return None
    return _warm_zygote(_Wiping.zygote, KINDS.index(language), _Wiping.warm, _Wiping.not_warm, _ready_to_wipe)


def _ready_to_wipe(warm: Zygote, kind: int) -> None:
    _calibrate_recursion(warm, kind)
    assert _Wiping.baseline is not None
    _Wiping.baseline.processes[warm.pid] = _wipe.process_state(warm.pid)  # (checked after each program)


def _warm_zygote(
    zygote: Zygote, kind: int, warm: dict[int, Zygote], not_warm: dict[int, str], ready: Callable[[Zygote, int], None]
) -> Zygote | None:
    """The warm zygote of ``kind`` (> 0) that ``zygote`` forks at the env's first program of that
    kind, kept in ``warm`` (why there is none, in ``not_warm``); ``ready(it, kind)`` once, before
    its first program."""
    if kind not in warm and kind not in not_warm:
        try:
            made = zygote.fork_warm(kind)
        except (ZygoteGone, OSError) as exc:
            not_warm[kind] = f"{type(exc).__name__}: {exc}"
            return None
        ready(made, kind)
        warm[kind] = made
    return warm.get(kind)


#: What a program forked to read its recursion depth runs instead of ``main<n>`` (its ``n``; see
#: :func:`_calibrate_recursion`)
_PROBE_N = -1


def _calibrate_recursion(zygote: Zygote, kind: int, fresh: bool = False) -> None:
    """Have ``zygote`` hide the runner's levels below its programs of ``kind`` (:mod:`_recursion`):
    a probe forked as they are (``fresh``: into fresh namespaces, :func:`_probe_fresh`) reads its
    depth where their code would start; the zygote takes the levels to hide as an integer. Where
    this fails, each program reads its depth itself."""
    try:
        if fresh:
            result = _probe_fresh(zygote, kind)
            answered = result["return_code"] == 0 and result["fresh"]
        else:
            result = _supervise(_from_zygote(zygote, _PROBE_N, -1, kind), 5.0, 64)
            answered = result["return_code"] == 0
        probed = {"depth": int(result["stdout"])} if answered else {}
        hidden = _levels_to_hide(probed, kind)
        if hidden is not None:
            zygote.adjust(hidden)
    except (ZygoteGone, OSError, ValueError):
        pass


def _levels_to_hide(probed: dict, kind: int) -> int | None:
    """The runner's levels below a program of ``kind`` (:mod:`_recursion`), from the depth a probe
    forked as the program is read (``probed``; ``{}`` where it could not): None where unknown."""
    module = KINDS[kind] != "python"
    top = _recursion.TOP_OF_MODULE if module else _recursion.TOP_OF_SCRIPT
    return _recursion.hidden_below(probed, top, _recursion.RUN_MODULE_LEVELS if module else 0)


def _probe_fresh(zygote: Zygote, kind: int) -> dict:
    """A recursion probe of ``kind`` cloned by ``zygote`` into fresh namespaces, an empty request
    staged for its P: the run's result (see :func:`_run_fresh`)."""
    _fresh.new_stage()
    _fresh.write_request(10.0, [], 0, [])
    return _run_fresh(zygote, _PROBE_N, -1, kind, 10.0, 64)


def _zygote_warm(kind: int) -> None:
    """In a warm zygote, forked by the zygote: what every program of ``kind`` needs, done once
    (``_warm``). Where it fails, the programs still run: each starts what the warm-up would have."""
    fork_hooks.restore()
    if KINDS[kind] == "pytest":
        _warm.start_pytest({**PROGRAM_ENV, "HOME": "/"})
    fork_hooks.suspend()  # (unless the warm-up left a thread running)


def _from_zygote(zygote: Zygote, n: int, memory_mb: int, kind: int = 0) -> _Started:
    """Have the zygote fork the program ``main<n>`` of ``kind`` (:data:`KINDS`); it reaps it and
    reports its status."""
    out_r, out_w, err_r, err_w = _pipes()
    try:
        pid, pidfd = zygote.start(n, memory_mb, out_w, err_w, kind)
    finally:
        os.close(out_w)
        os.close(err_w)

    def reap() -> int | None:
        try:
            return zygote.status(timeout=2.0)
        except ZygoteGone:
            return None  # (the wipe's check then finds the zygote gone: a hard reset follows)

    return _Started(pid, pidfd, out_r, err_r, reap)


# ------------------------------------------------------------------------------ fresh namespaces
#: Seconds past a program's deadline the env waits for P's report before it kills P itself, and
#: the rate at which the grace grows with what P copies in and out
_FRESH_GRACE_S = 5.0
_FRESH_BYTES_PER_S = 20e6
_ALL_SIGNALS = tuple(int(s) for s in signal.valid_signals())  # (ints: a fork that reads them copies no enum page)
_NO_DIRECTORY = "/nonexistent/boltzlabs"  # (P's first sys.path entry where it was the current directory)


def _run_program_fresh(action: dict, workspace: str) -> dict:
    """A program in namespaces of its own (:mod:`_fresh`): its request staged, then run: a Python
    program forked by P, any other compiled and run by P with its toolchain."""
    language = action["language"]
    kind = KINDS.index(language) if language in KINDS and _why_not(language) is None else -1
    zygote = _fresh_zygote_for(kind) if kind >= 0 else None  # (before this request is staged)
    toolchain = zygote is None
    if toolchain:
        why = _why_not(_languages.ALIASES.get(language, language))
        if why is not None:  # (nothing runs: the env stays clean)
            return {"compile_result": None, "run_result": _error(why), "files": {}, "fresh": True}
    fetch = list(action.get("fetch_files") or [])
    max_file_bytes = int(action.get("max_file_bytes", 16 << 20))
    try:  # (what the request gets wrong fails it before any program runs: the env stays clean)
        for name in fetch:
            _file_path(workspace, name)
        _fresh.new_stage()
        staged = _write_files(workspace, action.get("files") or {}, stage=True)
        stdin = _fresh.staged(STDIN_PATH)
        os.makedirs(os.path.dirname(stdin), exist_ok=True)
        with open(stdin, "wb") as f:
            f.write((action.get("stdin") or "").encode("utf-8", "surrogateescape"))
        if toolchain:  # (P writes the source where its language wants it, as the toolchain path does)
            action["code"].encode("utf-8", "surrogateescape")  # (one it cannot write fails here, not in P)
            _fresh.write_toolchain(action)
            n, sources = 0, []
        else:
            n, src = _source_path(workspace, _SUFFIXES[kind], action["code"], stage=True)
            sources = [src]
    except ValueError as exc:
        _fresh.clear_stage()
        return {"compile_result": None, "run_result": _error(f"ValueError: {exc}"), "files": {}, "fresh": True}
    timeout = float(action["run_timeout"])
    paths = list(dict.fromkeys([*staged, STDIN_PATH, *sources]))  # (a request file may be where stdin goes)
    _fresh.write_request(timeout, fetch, max_file_bytes, paths)
    cap = int(action.get("max_output_bytes", 1 << 20))
    # P copies the staged files in before the program and the fetched ones out after it
    moved = sum(os.path.getsize(_fresh.staged(p)) for p in paths) + max_file_bytes * len(fetch) * 4 // 3
    grace = _FRESH_GRACE_S + moved / _FRESH_BYTES_PER_S
    assert _Fresh.zygote is not None
    if toolchain:
        # (what it compiles and runs writes its outputs, at most ``cap`` each, through the stage)
        grace += 4 * cap / _FRESH_BYTES_PER_S
        return _run_fresh_toolchain(_Fresh.zygote, timeout + float(action.get("compile_timeout", 10)), grace)
    assert zygote is not None
    run = _run_fresh(zygote, n, int(action.get("memory_limit_mb", -1)), kind, timeout, cap, grace)
    files = run.pop("files")
    return {"compile_result": None, "run_result": run, "files": files, "fresh": run.pop("fresh")}


def _run_fresh(zygote: Zygote, n: int, memory_mb: int, kind: int, timeout: float, cap: int, grace: float = 5.0) -> dict:
    """Have the zygote fork ``main<n>`` (staged, with its request) into fresh namespaces; the run's
    result, with the fetched ``files``, and ``fresh`` saying whether the env is clean after it: P
    reported in full, found no named socket left, and exited 0 (its status read from the zygote)."""
    started = _from_zygote(zygote, n, memory_mb, kind)
    result = _supervise(started, timeout + grace, cap)
    report = _fresh.report()
    _fresh.clear_stage()  # (the request and its results: read, and nothing of them kept)
    if report is None:  # P failed before the program could start (it said why on the program's stderr)
        return {**_namespaces_failed(result), "fresh": False, "files": {}}
    if "status" not in report:  # the program ran, and its PID 1 could not say how it ended: its own doing
        result["status"], result["return_code"] = FINISHED, 1
        result["stderr"] += "\nboltzlabs: the program's PID 1 could not report how it ended (its limits changed?)\n"
        result["fresh"], result["files"] = False, {}
        return result
    result["fresh"], result["files"] = _clean_after(result, report), report["files"]  # (P's status: before it goes)
    result["execution_time"] = round(float(report["elapsed"]), 6)
    if report["timed_out"]:
        result["status"], result["return_code"] = TIMEOUT, None
    else:
        result["status"], result["return_code"] = FINISHED, _return_code(report["status"])
    if report.get("files_lost"):
        result["stderr"] += _FILES_LOST
    return result


def _namespaces_failed(p: dict) -> dict:
    """The run's error where P (``p``: its run, as :func:`_supervise` saw it) reported nothing."""
    why = p["stderr"].strip() or f"its PID 1 {p['status']}, return code {p['return_code']}"
    return _error(f"the program's fresh namespaces failed: {why}")


def _clean_after(p: dict, report: dict) -> bool:
    """Whether the env is clean after P's run (``p``) and ``report``: P exited 0, and no unix socket
    of the program outlived it."""
    return p["status"] == FINISHED and p["return_code"] == 0 and report["sockets"] == _Fresh.sockets


_FILES_LOST = "\nboltzlabs: the fetched files did not fit the sandbox's /tmp on their way out\n"


def _fresh_zygote_for(kind: int) -> Zygote | None:
    """The zygote that clones P for programs of ``kind`` (:data:`KINDS`): the zygote for Python; for
    a warm language (pytest) a warm zygote it forks, in its user namespace, at the env's first such
    program (it never sees the env's memory either), whose runner levels a probe run in fresh
    namespaces calibrates; None where there can be none (P then runs the language's toolchain)."""
    if kind == 0 or _Fresh.zygote is None:
        return _Fresh.zygote
    return _warm_zygote(_Fresh.zygote, kind, _Fresh.warm, _Fresh.not_warm, _ready_fresh)


def _ready_fresh(warm: Zygote, kind: int) -> None:
    _Fresh.sockets = _fresh.unix_sockets()  # (the env's own now: with its socket pair with the warm zygote)
    _calibrate_recursion(warm, kind, fresh=True)


def _run_fresh_toolchain(zygote: Zygote, timeout: float, grace: float) -> dict:
    """Have the zygote clone P for the toolchain program staged (:func:`_fresh.write_toolchain`):
    its compile and run results as P hands them back, its fetched ``files``, and ``fresh`` (as
    :func:`_run_fresh` says it). P's own output is only what it says when it fails."""
    started = _from_zygote(zygote, 0, -1)  # (each command's memory limit is the request's, set by P)
    p = _supervise(started, timeout + grace, 1 << 16)
    report, results = _fresh.report(), _fresh.results()
    _fresh.clear_stage()
    if report is None or results is None or "status" not in report:
        return {"compile_result": None, "run_result": _namespaces_failed(p), "files": {}, "fresh": False}
    run = results.get("run_result")
    if report.get("files_lost") and isinstance(run, dict) and isinstance(run.get("stderr"), str):
        run["stderr"] += _FILES_LOST
    return {
        "compile_result": results.get("compile_result"),
        "run_result": run,
        "files": report["files"],
        "fresh": _clean_after(p, report),
    }


def _fresh_zygote_prepare() -> None:
    """Once, in the fresh-namespaces zygote: its own user namespace, then what every program shares."""
    _Fresh.cap_last = _fresh.nest()
    _Fresh.program_filter = _fresh.program_filter()
    _Fresh.points = mount_points()
    _zygote_prepare()


def _fresh_program(n: int, memory_mb: int, out_w: int, err_w: int, kind: int) -> int:
    """P, cloned by the zygote as PID 1 of a new PID namespace: the program's other namespaces and
    its places, the program, then its fetched files and status handed back (:class:`_fresh.Run`)."""
    _Fresh.in_program_namespaces = True
    # P's working directory becomes the program's workspace: no import of P's may look there (a
    # Python program, forked from P, puts its own directory in the first entry, as ``python main.py``)
    here = ("", ".")
    head = [_NO_DIRECTORY if entry in here else entry for entry in sys.path[:1]]
    sys.path[:] = head + [entry for entry in sys.path[1:] if entry not in here]
    # (every signal blocked: the program sees its PID 1, and the kernel delivers it only handled ones)
    unblocked = _Fresh.unblocked = tuple(_signal.pthread_sigmask(_signal.SIG_BLOCK, _ALL_SIGNALS))
    try:
        run = _fresh.Run(_Fresh.tmpfs_bytes, _Fresh.points)
        run.enter(_Fresh.cap_last, _Fresh.program_filter)
    except BaseException as exc:
        os.write(err_w, f"could not make them: {type(exc).__name__}: {exc}\n".encode())
        return 1

    def program() -> int:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, unblocked)
        return _zygote_program(n, memory_mb, out_w, err_w, kind)

    try:
        if run.toolchain is not None:  # (P compiles and runs it: see _compile_and_run)
            status, timed_out, elapsed = 0, False, run.run_here(functools.partial(_compile_and_run, run.toolchain))
        else:
            status, timed_out, elapsed = run.run(program)
        files = _fetch(SANDBOX_WORKSPACE, {"fetch_files": run.fetch, "max_file_bytes": run.max_file_bytes})
        run.hand_back(files, status, timed_out, elapsed)
    except BaseException as exc:
        os.write(err_w, f"P failed: {type(exc).__name__}: {exc}\n".encode())
        return 1
    return 0


def _compile_and_run(action: dict) -> dict:
    """In P, a program of a toolchain language: compiled and run as :func:`_run_toolchain` does
    (each command a child of P with the request's deadline, memory limit and output cap), in the
    program's places; both results."""
    scratch = scratch_dir(SANDBOX_WORKSPACE)
    os.makedirs(scratch, exist_ok=True)
    compiled, ran = _run_toolchain(action["language"], action, SANDBOX_WORKSPACE, scratch, STDIN_PATH)
    return {"compile_result": compiled, "run_result": ran}


def _zygote_prepare() -> None:
    """Once, in the zygote: what every program it forks shares, inherited instead of set up by
    each program (its working directory, umask, environment, signal handlers, std streams and the
    programs' seccomp filter); then a program's own set-up is its session, its pipes and its seed."""
    workspace = _Wiping.workspace = workspace_now()
    os.chdir(workspace)
    os.umask(0o022)
    _program_environment(workspace)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    # the streams' objects are made over a file (stdin) and pipes (stdout, stderr) like the ones each
    # program gets on the same fds, so that what they find out about their fd at creation holds
    out_r, out_w = os.pipe()
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    for fd in (out_r, out_w):
        os.close(fd)
    _program_streams()
    if _Wiping.child_filter is not None:
        seccomp.install(_Wiping.child_filter)
    _wipe.set_dumpable(False)  # (it is already: this resolves the call each program makes)
    fork_hooks.suspend()  # (each program restores them first)


def _zygote_program(n: int, memory_mb: int, out_w: int, err_w: int, kind: int) -> int:
    """In a program forked by the zygote (prepared by :func:`_zygote_prepare`): its own session,
    limit and pipes, then ``main<n>`` of its ``kind``."""
    fork_hooks.restore()
    workspace = _Wiping.workspace  # (the zygote's working directory already: it chdir-ed there)
    _own_session(memory_mb)
    kind = kind if 0 <= kind < len(KINDS) else 0
    if n == _PROBE_N:  # (no program: reads its depth where one would start; see _calibrate_recursion)
        _wire_stdio(os.devnull, out_w, err_w)
        return _run_python_here(["-m", _PROBE] if kind else [_PROBE], workspace, prepared=True)
    _wire_stdio(STDIN_PATH, out_w, err_w)
    return _run_python_here(_program_argv(kind, _main_path(workspace, n, _SUFFIXES[kind])), workspace, prepared=True)


#: What follows the number in each kind's source file name (``main<n>.py``: ``.py``)
_SUFFIXES = tuple(_numbered_suffix(_languages.LANGUAGES[kind].source) for kind in KINDS)


def _program_environment(workspace: str) -> None:
    os.environ.clear()
    os.environ.update(PROGRAM_ENV, HOME=workspace)


def _program_streams() -> None:
    """``sys.stdin``/``stdout``/``stderr`` (and their ``__x__``) over fds 0-2, as Python makes them."""
    import io

    stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="backslashreplace"
    )
    stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    for name, stream in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run_python_here(argv: list[str], workspace: str, prepared: bool = False) -> int:
    """The forked child's program, as ``python <argv>`` runs it: a script (``[src]``) in a fresh
    ``__main__``, or a module (``["-m", module, *args]``) as ``runpy`` runs it; its exit status.
    ``prepared``: forked from a zygote that made the streams and the environment already."""
    if not prepared:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        _program_streams()
        _program_environment(workspace)
    # (no random.seed() here: random reseeds itself in every child of os.fork, its at-fork hook)
    sys.path[0] = workspace  # (the script's directory; for -m the working directory, the same here)
    status = 0
    try:
        if argv[0] == "-m":
            _run_module(argv[1], argv[2:])
        else:
            _run_script(argv[0])
    except SystemExit as exc:
        status = _exit_status(exc, sys.stderr)
    except BaseException as exc:
        _print_uncaught(exc)
        status = 1
    _exit_as_python_does()
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except BaseException:
            status = status or 1  # as the interpreter exits when its stdout cannot be flushed
    return status


def _print_uncaught(exc: BaseException) -> None:
    """Report an exception the program did not catch as the interpreter does at its top level:
    through ``sys.excepthook`` (the C default, or the program's own), from the program's first
    frame. (The ``traceback`` module would format the same text at the cost of a few hundred more
    copied pages in a forked program, and would pass over a hook the program set.)"""
    tb = exc.__traceback__ = _program_frames(exc.__traceback__)
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_failed:  # as the interpreter: the hook's own error, then the original
        print("Error in sys.excepthook:", file=sys.stderr)
        hook_failed.__context__ = None  # (raised while ``exc`` was handled here, not in the interpreter)
        failed_tb = hook_failed.__traceback__ = _program_frames(hook_failed.__traceback__)
        sys.__excepthook__(type(hook_failed), hook_failed, failed_tb)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)


def _program_frames(tb):
    """A traceback without the runner's frames: this file's below the program (its own start where
    the interpreter's would), and the last one where the error was raised in the program's
    ``sys.setrecursionlimit`` (:mod:`_recursion`'s, a builtin's under ``python main.py``)."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    last = tb
    while last is not None and last.tb_next is not None:
        if last.tb_next.tb_next is None and last.tb_next.tb_frame.f_code.co_filename == _recursion.__file__:
            last.tb_next = None
        else:
            last = last.tb_next
    return tb


#: The name a probe program runs under (:func:`_calibrate_recursion`)
_PROBE = "<recursion probe>"


def _run_script(src: str) -> None:
    if src == _PROBE or not _recursion.calibrated:  # (a probe; or forked by an env: no zygote hid the levels)
        probed = _recursion.probe()
        exec(_recursion.PROBE, probed)  # (as the program, from this frame: its depth is the program's)
        if src == _PROBE:
            print(probed["depth"])
            return
        _recursion.start_at_top_level(probed)
    sys.argv = [src]
    main = types.ModuleType("__main__")
    main.__file__ = src
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    with open(src, "rb") as f:
        source = f.read()
    exec(compile(source, src, "exec"), main.__dict__)


def _run_module(module: str, args: list[str]) -> None:
    import runpy

    if module == _PROBE or not _recursion.calibrated:
        probed = _recursion.probe()
        exec(_recursion.PROBE, probed)
        if module == _PROBE:
            print(probed["depth"])
            return
        _recursion.start_at_top_level(probed, _recursion.TOP_OF_MODULE, _recursion.RUN_MODULE_LEVELS)
    sys.argv = ["-m", *args]  # (runpy puts the module's file in sys.argv[0], as python -m does)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _exit_as_python_does() -> None:
    """Join the program's threads and run its ``atexit`` functions, as the interpreter does at exit
    (each only where the program started a thread or registered a function: both cost)."""
    try:
        if threading.active_count() > 1 or getattr(threading, "_threading_atexits", None):
            threading._shutdown()  # type: ignore[attr-defined]
        if atexit._ncallbacks():
            atexit._run_exitfuncs()
    except BaseException:
        pass


def _exit_status(exc: SystemExit, stderr) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    try:
        print(exc.code, file=stderr)
    except BaseException:
        pass
    return 1


# ------------------------------------------------------------------------------ watching programs
def _supervise(started: _Started, timeout: float, cap: int) -> dict:
    """Collect a started program's output (at most ``cap`` bytes each) until it exits or ``timeout``
    passes; then kill its process group, whatever is left of it."""
    pid, pidfd, out_r, err_r = started.pid, started.pidfd, started.out_r, started.err_r
    t0 = time.monotonic()
    deadline = t0 + float(timeout)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    sizes = {out_r: 0, err_r: 0}
    dropped = {out_r: 0, err_r: 0}
    open_fds = [out_r, err_r]
    status = None
    reaped = timed_out = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([*open_fds, pidfd], [], [], left)
            for fd in ready:
                if fd == pidfd:
                    continue
                data = os.read(fd, 65536)
                if not data:
                    open_fds.remove(fd)
                    continue
                keep = max(0, cap - sizes[fd])
                chunks[fd].append(data[:keep])
                sizes[fd] += min(len(data), keep)
                dropped[fd] += len(data) - min(len(data), keep)
            if pidfd in ready:
                status, reaped = started.reap(), True
                break
        elapsed = time.monotonic() - t0
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if not reaped:
            try:
                status = started.reap()
            except ChildProcessError:
                pass
        for fd in open_fds:  # what the program wrote before it ended and nobody read yet
            while sizes[fd] < cap and select.select([fd], [], [], 0)[0]:
                data = os.read(fd, min(65536, cap - sizes[fd]))
                if not data:
                    break
                chunks[fd].append(data)
                sizes[fd] += len(data)
        for fd in (out_r, err_r, pidfd):
            os.close(fd)
    result = {
        "status": TIMEOUT if timed_out else FINISHED,
        "execution_time": round(elapsed, 6),
        "return_code": None if timed_out else _return_code(status),
        "stdout": b"".join(chunks[out_r]).decode("utf-8", "replace"),
        "stderr": b"".join(chunks[err_r]).decode("utf-8", "replace"),
        "truncated": {name: n for name, n in (("stdout", dropped[out_r]), ("stderr", dropped[err_r])) if n},
    }
    return result


def _return_code(status: int | None) -> int | None:
    if status is None:
        return None
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)  # as subprocess reports a signal: SIGKILL (an OOM kill, say) is -9
    return os.WEXITSTATUS(status)


serve(reset=reset, step=step)
