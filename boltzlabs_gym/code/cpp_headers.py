"""Precompiled C++ standard headers, built once at install and read by every compile.

A trivial C++ program spends most of its compile parsing the standard headers it includes first:
``<iostream>`` or, in competitive programming, ``<bits/stdc++.h>``. ``boltzlabs-gym code-runtime
install`` precompiles those two (:data:`CPP_HEADERS`) with the language table's own compile flags
into ``<runtime>/cpp`` (:func:`build`), and the table's ``g++`` command searches that directory
first (``-I{runtime}/cpp``). GCC then reads ``iostream.gch`` where a program's first ``#include``
is ``<iostream>``, and parses the header itself otherwise: where the program's first include is
another header, where a macro defined before it differs from the one the header was built under,
or where the file is stale (another g++). Beside each ``.gch`` lies a header of the same name that
says only ``#include_next <iostream>``: GCC opens it wherever it does not read the ``.gch`` (the
same header included again, say), and it leads to the standard one. A precompiled header holds
what parsing the standard header gives and nothing of any program, and it is read-only: it
carries nothing between requests.

>>> from boltzlabs_gym.code.cpp_headers import CPP_HEADERS
>>> CPP_HEADERS
('bits/stdc++.h', 'iostream')
"""

from __future__ import annotations

import logging
import os
import tempfile

from .install_step import RuntimeInstallError, publish_read_only, run_toolchain
from .languages import _TABLE

__all__ = ["CPP_HEADERS", "build", "header_path"]

log = logging.getLogger(__name__)

#: The standard headers precompiled, as a program's ``#include <...>`` names them.
CPP_HEADERS: tuple[str, ...] = tuple(_TABLE.CPP_HEADERS)


def header_path(runtime: str, header: str) -> str:
    """Where the precompiled ``header`` (:data:`CPP_HEADERS`) of the code runtime ``runtime`` is."""
    return os.path.join(runtime, "cpp", f"{header}.gch")


def build(runtime: str, timeout: float = 300.0) -> dict[str, str]:
    """Precompile :data:`CPP_HEADERS` into ``<runtime>/cpp`` with the flags of the language table's
    C++ compile; header -> path, or header -> why it was not made (g++ missing). Raises
    :class:`RuntimeInstallError` where g++ fails on a header."""
    spec = _TABLE.LANGUAGES["cpp"]
    why = spec.why_not(_TABLE.PATH, runtime)
    if why is not None:
        return {header: f"not made: cpp cannot run here ({why})" for header in CPP_HEADERS}
    flags = compile_flags(spec.compile)
    done = {}
    with tempfile.TemporaryDirectory(prefix="blg-cpp-header-") as work:
        for header in CPP_HEADERS:
            path = header_path(runtime, header)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write_read_only(path.removesuffix(".gch"), f"#include_next <{header}>\n")
            wrapper = os.path.join(work, "header.h")
            with open(wrapper, "w") as f:
                f.write(f"#include <{header}>\n")
            partial = f"{path}.partial"
            cmd = [spec.compile[0], *flags, "-x", "c++-header", wrapper, "-o", partial]
            failed = f"g++ could not precompile <{header}>"
            run_toolchain(cmd, work, timeout, failed)
            if not os.path.exists(partial):
                raise RuntimeInstallError(f"{failed}: it wrote no {partial}")
            publish_read_only(partial, path)
            done[header] = path
            log.info("code runtime: precompiled <%s>: %s", header, path)
    return done


def _write_read_only(path: str, text: str) -> None:
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(text)
    publish_read_only(partial, path)


def compile_flags(compile_cmd: tuple[str, ...]) -> list[str]:
    """The flags of the table's C++ compile that decide whether a precompiled header fits (the
    language standard, optimisation, definitions): without the program, the output, the libraries
    and the include directories.

    >>> compile_flags(("g++", "-std=c++17", "-O2", "-I{runtime}/cpp", "{src}", "-o", "{exe}", "-lpthread"))
    ['-std=c++17', '-O2']
    """
    flags, skip = [], False
    for part in compile_cmd[1:]:
        if skip:
            skip = False
        elif part == "-o":
            skip = True
        elif "{" not in part and not part.startswith(("-l", "-I", "-L")):
            flags.append(part)
    return flags
