"""Class-data-sharing archives of the JVM toolchains' own classes, dumped once at install.

A trivial Java, JUnit or Scala program spends most of its CPU in the JVMs of its toolchain
loading and verifying their own classes (javac's, scalac's, the JUnit console's) before any of
the program's. ``boltzlabs-gym code-runtime install`` runs each tool once, on a trivial program,
with ``-XX:ArchiveClassesAtExit`` (:func:`build`), and the language table's commands
(``runner_env/_languages.py``, :data:`JVM_ARCHIVES`) map the archive read-only at every later
start: javac 0.7 s -> 0.35 s, scalac 3.2 s -> 1.4 s (with C1 alone), the JUnit console 0.85 s ->
0.5 s, on the 2-vCPU machine of the docs. An archive holds the tools' classes as loaded from the
toolchain's files and nothing of any program, so it carries nothing between requests.

Each archive is dumped from the same command the table runs (the ``SharedArchiveFile`` flag
swapped for ``ArchiveClassesAtExit``), so that the class path, the boot class path and the flags
that decide whether an archive fits are the ones the programs' runs use. A JDK upgrade makes
an archive stale; the JVM then ignores it silently, and installing again refreshes it.

>>> from boltzlabs_gym.code.jvm_archives import JVM_ARCHIVES
>>> "javac" in JVM_ARCHIVES and "scalac" in JVM_ARCHIVES
True
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterable

from .install_step import RuntimeInstallError, publish_read_only, run_toolchain
from .languages import _TABLE

__all__ = ["JVM_ARCHIVES", "archive_path", "build"]

log = logging.getLogger(__name__)

#: The archives the language table's commands map (``<runtime>/jvm/<name>.jsa``).
JVM_ARCHIVES: tuple[str, ...] = tuple(_TABLE.JVM_ARCHIVES)

#: A trivial program per language whose toolchain has archives: running it runs every tool once.
_PROGRAMS = {
    "java": 'public class Main { public static void main(String[] a) { System.out.println("hi"); } }\n',
    "junit": (
        "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
        "public class MainTest { @Test void ok() { assertEquals(2, 1 + 1); } }\n"
    ),
    "scala": 'object Main { def main(args: Array[String]): Unit = println("hi") }\n',
    "kotlin_script": 'println("hi")\n',
}
_ARCHIVE_FLAG = "-XX:SharedArchiveFile="


def archive_path(runtime: str, name: str) -> str:
    """Where the archive ``name`` (:data:`JVM_ARCHIVES`) of the code runtime ``runtime`` is."""
    return os.path.join(runtime, "jvm", f"{name}.jsa")


def build(runtime: str, languages: Iterable[str] | None = None, timeout: float = 300.0) -> dict[str, str]:
    """Dump every archive whose toolchain is installed into ``<runtime>/jvm`` (those of ``languages``
    alone, where given: ``java``, ``junit``, ``scala``, ``kotlin_script``); name -> path, or name ->
    why it was not made (its toolchain missing). Raises :class:`RuntimeInstallError` where a tool
    fails on its trivial program."""
    os.makedirs(os.path.join(runtime, "jvm"), exist_ok=True)
    done: dict[str, str] = {}
    wanted = set(_PROGRAMS if languages is None else languages)
    if wanted - set(_PROGRAMS):
        raise ValueError(f"no JVM archives for {sorted(wanted - set(_PROGRAMS))}; there are for {sorted(_PROGRAMS)}")
    for language, program in _PROGRAMS.items():
        if language not in wanted:
            continue
        spec = _TABLE.LANGUAGES[language]
        why = spec.why_not(_TABLE.PATH, runtime)
        if why is not None:
            for name in _archives_of(spec):
                done.setdefault(name, f"not made: {language} cannot run here ({why})")
            continue
        with tempfile.TemporaryDirectory(prefix="blg-jvm-archive-") as work:
            for step in (spec.compile, spec.run):
                if step is not None:
                    _run_dumping(_filled(step, spec, work, runtime, program), work, done, timeout)
    return done


def _archives_of(spec) -> list[str]:
    commands = [c for c in (spec.compile, spec.run) if c is not None]
    return [_archive_name(part.partition(_ARCHIVE_FLAG)[2]) for c in commands for part in c if _ARCHIVE_FLAG in part]


def _archive_name(path: str) -> str:
    """The archive's name (:data:`JVM_ARCHIVES`) from its path in a command (``{runtime}/jvm/javac.jsa``)."""
    return os.path.basename(path).removesuffix(".jsa")


def _filled(step: tuple[str, ...], spec, work: str, runtime: str, program: str) -> list[str]:
    """``step`` with its placeholders filled for ``program`` written in ``work`` (as the env fills them)."""
    main = spec.main_of(program) or "Main"
    source = os.path.join(work, spec.source.format(n="", main=main))
    with open(source, "w") as f:
        f.write(program)
    names = {**spec.placeholders(work, work, runtime, sys.executable, main), "src": source}
    return [part.format(**names) for part in step]


def _run_dumping(cmd: list[str], work: str, done: dict[str, str], timeout: float) -> None:
    """Run ``cmd``; where it maps an archive not dumped yet, dump that archive instead of mapping it."""
    for i, part in enumerate(cmd):
        flag = part.partition(_ARCHIVE_FLAG)
        if not flag[1]:
            continue
        path = flag[2]
        name = _archive_name(path)
        if name in done:
            continue
        partial = f"{path}.partial"
        cmd = [*cmd[:i], f"{flag[0]}-XX:ArchiveClassesAtExit={partial}", *cmd[i + 1 :]]
        _run(cmd, work, timeout)
        if not os.path.exists(partial):
            raise RuntimeInstallError(f"the JVM made no class-data-sharing archive for {name} ({' '.join(cmd)})")
        publish_read_only(partial, path)
        done[name] = path
        log.info("code runtime: JVM archive %s: %s", name, path)
        return
    _run(cmd, work, timeout)


def _run(cmd: list[str], work: str, timeout: float) -> None:
    run_toolchain(cmd, work, timeout, f"{' '.join(cmd[:2])} ... failed on a trivial program")
