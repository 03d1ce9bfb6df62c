"""Precompiled C++ standard headers (code/cpp_headers.py): built with the language table's compile
flags, read by its compile where a program's first include names them, harmless where missing."""

from __future__ import annotations

import os
import subprocess

import pytest

from boltzlabs_gym.code import CodeRunner
from boltzlabs_gym.code.cpp_headers import CPP_HEADERS, build, header_path
from boltzlabs_gym.code.languages import _TABLE, availability, runtime_dir


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    why = availability()["cpp"]
    if why is not None:
        pytest.skip(f"cpp cannot run on this host: {why}")
    where = str(tmp_path_factory.mktemp("runtime"))
    made = build(where)
    assert made == {header: header_path(where, header) for header in CPP_HEADERS}, made
    return where


def compile_cpp(runtime: str, work, program: str) -> str:
    """Compile ``program`` with the table's command (and ``-H``, which lists what g++ reads: ``!`` marks
    a precompiled header it used); its stderr."""
    spec = _TABLE.LANGUAGES["cpp"]
    src = work / "main.cpp"
    src.write_text(program)
    names = {**spec.placeholders(str(work), str(work), runtime, "python3", "main"), "src": str(src)}
    cmd = [part.format(**names) for part in spec.compile]
    done = subprocess.run([*cmd, "-H", "-Winvalid-pch"], capture_output=True, text=True, timeout=120, cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    assert subprocess.run([names["exe"]], capture_output=True, text=True, timeout=30).stdout == "ok\n"
    return done.stderr


def test_a_program_whose_first_include_is_precompiled_reads_it(runtime, tmp_path):
    for header in CPP_HEADERS:
        gch = header_path(runtime, header)
        assert os.stat(gch).st_mode & 0o777 == 0o444
        err = compile_cpp(
            runtime, tmp_path, f'#include <{header}>\n#include <iostream>\nint main() {{ std::cout << "ok\\n"; }}\n'
        )
        assert f"! {gch}" in err, err[:2000]


def test_any_other_program_compiles_as_without_them(runtime, tmp_path):
    """Another first include, or a macro defined before it that the header was not built under:
    g++ parses the headers itself, and the program is the same."""
    for program in (
        '#include <vector>\n#include <iostream>\nint main() { std::cout << "ok\\n"; }\n',
        '#define _GLIBCXX_DEBUG 1\n#include <bits/stdc++.h>\nint main() { std::cout << "ok\\n"; }\n',
    ):
        err = compile_cpp(runtime, tmp_path, program)
        assert not any(line.startswith("! ") for line in err.splitlines()), err[:2000]  # (none read)


def test_the_runner_compiles_with_the_installed_runtimes_headers_or_without():
    """Through the sandbox: the code runtime's precompiled headers where it has them (an install
    without them, or a stale one, compiles the same program from the headers)."""
    why = availability()["cpp"]
    if why is not None:
        pytest.skip(f"cpp cannot run on this host: {why}")
    installed = all(os.path.exists(header_path(runtime_dir(), h)) for h in CPP_HEADERS)
    program = '#include <bits/stdc++.h>\nint main() { int x; std::cin >> x; std::cout << x * 2 << "\\n"; }\n'
    with CodeRunner(envs_per_lane=1, lanes=1) as runner:
        r = runner.run(program, "cpp", stdin="21")
    assert r.ok and r.stdout == "42\n", (installed, r)
