"""The languages the code runner's env runs: for each, its source file, compile and run commands,
the toolchain it needs, and the runtime libraries programs expect, as SandboxFusion runs them.

Each :class:`Language` follows SandboxFusion's runner for the same name (``sandbox/runners/major.py``
and ``minor.py``): the same file names, the same split between a compile step (its own
``compile_timeout``, reported as ``compile_result``) and the run, and the same test frameworks
(``pytest``, ``go_test``, ``junit``, ``jest``, ``D_ut``). Where SandboxFusion calls a toolchain
Debian does not ship, the nearest Debian one stands in (:data:`STAND_INS`, ``docs/code-server.md``
"Languages").

Commands are argument lists with placeholders, filled per program from :meth:`Language.placeholders`:
``{src}`` the source file, ``{exe}`` a binary in the env's scratch directory, ``{dir}`` the
workspace, ``{scratch}`` the scratch directory, ``{cp}`` a Java class path, ``{main}`` the class
or object to run, ``{python}`` the interpreter programs run under, ``{runtime}`` the code runtime
(``boltzlabs-gym code-runtime install``: Node.js packages, a Python venv).

Standard library only; runs inside the sandbox (and on the host, for ``boltzlabs-gym code-languages``).

>>> LANGUAGES["cpp"].compile
('g++', '-std=c++17', '-O2', '-I{runtime}/cpp', '{src}', '-o', '{exe}', '-lpthread')
>>> LANGUAGES["scala"].main_of("object Hello { def main(a: Array[String]) = () }")
'Hello'
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

#: Where ``boltzlabs-gym code-runtime install`` puts what programs expect beyond the toolchains
#: (Node.js's tsx, jest and babel; a Python venv). Under ``/usr``, which every sandbox shows read-only.
DEFAULT_RUNTIME = "/usr/local/lib/boltzlabs-code-runtime"
#: The directory Debian's Java libraries are in (javatuples, JUnit 5's console launcher).
JAVA_LIBS = "/usr/share/java"
#: Go packages Debian ships as source (testify for ``go_test``), a GOPATH.
DEBIAN_GOPATH = "/usr/share/gocode"
#: Where SandboxFusion's toolchain is not Debian's: ``(language, theirs, ours)``.
STAND_INS = (
    ("csharp", "dotnet 8 (dotnet run)", "Mono 6.8 (mcs, then mono)"),
    ("D_ut", "dmd", "LDC 1.30 (ldmd2, its dmd-compatible driver)"),
    ("go", "Go 1.23 with modules from the proxy", "Go 1.19, GOPATH mode over Debian's Go packages"),
    ("go_test", "Go 1.23 with modules from the proxy", "Go 1.19, GOPATH mode over Debian's Go packages"),
    ("kotlin_script", "Kotlin 2.0 (kotlin x.kts)", "Kotlin 1.3 (kotlinc -script x.kts)"),
    ("java", "Oracle JDK 21", "OpenJDK 17"),
    ("junit", "JUnit console 1.8.2", "JUnit console 1.9.1 (Debian's junit5)"),
    ("lua", "Lua 5.2 with luarocks' luaunit", "Lua 5.4 with Debian's lua-unit"),
    ("php", "PHP 7.4", "PHP 8.2"),
    ("rust", "Rust 1.76", "Rust 1.63 (Debian's rustc)"),
)


@dataclass(frozen=True)
class Language:
    """How one language's program is compiled and run in the sandbox.

    ``source``: the program's file name (``{n}``: a number that avoids a file the request brought;
    ``{main}``: the class a Java program declares). ``needs``: the commands the toolchain must
    provide (looked up on :data:`PATH`) or files it reads (absolute paths), and what installs
    them (``debian``: Debian's packages; ``hint``: anything else). ``reserves_address_space``: the
    runtime maps far more than it uses (JVMs, Go, .NET, V8), so ``memory_limit_mb`` bounds its
    data segment (``RLIMIT_DATA``), not its address space.
    """

    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    needs: tuple[str, ...] = ()
    #: Debian's packages that provide ``needs``
    debian: tuple[str, ...] = ()
    #: what provides what Debian does not (the code runtime, say)
    hint: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    reserves_address_space: bool = False
    #: the source as written to the file (PHP's missing ``<?php`` tag added, say)
    rewrite: Callable[[str], str] | None = None
    #: the class or object a program runs (``{main}``), from its source; None: none found
    find_main: Callable[[str], str | None] | None = None
    #: what the run needs besides the toolchain (``node`` packages, jars) and where they are
    runtime_needs: tuple[str, ...] = ()
    #: jars on a Java program's class path (``{cp}``: the workspace, these, then the request's jars)
    class_path: tuple[str, ...] = ()
    #: files the toolchain reads beside the program (path with placeholders -> text), written before it compiles
    support: Mapping[str, str] = field(default_factory=dict)
    #: ``run`` is ``{python} -m <module> <args>``, which the env runs in a child of a warm zygote
    #: (``_warm``: the module started once there) rather than in a new interpreter
    warm: bool = False

    def warm_module(self) -> tuple[str, tuple[str, ...]]:
        """The module and arguments of a ``warm`` language's ``{python} -m <module> <args>``."""
        if not self.warm or self.run[:2] != ("{python}", "-m"):
            raise ValueError(f"{self.name} does not run as {{python}} -m <module>")
        return self.run[2], self.run[3:]

    def installs(self) -> str:
        """What installs this language's toolchain and runtime, in words."""
        parts = [f"Debian's {' '.join(self.debian)}"] if self.debian else []
        return "; ".join(parts + ([self.hint] if self.hint else []))

    def why_not(self, path: str, runtime: str, python: str | None = None) -> str | None:
        """Why this language cannot run here (what is missing, and what installs it), or None."""
        gone = self.missing(path, runtime, python)
        return f"missing {', '.join(gone)} (install: {self.installs()})" if gone else None

    def main_of(self, code: str) -> str | None:
        """The class or object ``code`` runs (``{main}``), or ``None``."""
        return self.find_main(code) if self.find_main else None

    def placeholders(
        self, workspace: str, scratch: str, runtime: str, python: str, main: str, jars: Iterable[str] = ()
    ) -> dict[str, str]:
        """The values of the commands' placeholders but ``{src}``, for a program in ``workspace``
        (``jars``: the ones its request brought, on a Java class path after the table's)."""
        return {
            "dir": workspace,
            "scratch": scratch,
            "exe": os.path.join(scratch, "program"),
            "runtime": runtime,
            "python": python,
            "main": main,
            "cp": ":".join([workspace, *self.class_path, *jars]),
        }

    def missing(self, path: str, runtime: str, python: str | None = None) -> list[str]:
        """What of the toolchain and runtime is not here (empty: the language runs). A need
        ``py:<module>`` is a module the programs' Python (``python``; default this one) imports."""
        gone = []
        for need in self.needs + self.runtime_needs:
            need = need.format(runtime=runtime)
            if need.startswith("py:"):
                found = _importable(need[3:], python)
                need = f"the Python module {need[3:]} (in {python or sys.executable})"
            elif os.path.isabs(need):
                found = os.path.exists(need)
            else:
                found = shutil.which(need, path=path) is not None
            if not found:
                gone.append(need)
        return gone


PATH = "/usr/local/bin:/usr/bin:/bin"


def _importable(module: str, python: str | None) -> bool:
    """Whether ``python`` (default: this interpreter) finds ``module``: this one looks it up; another,
    a venv's, is looked at in its ``site-packages`` (no interpreter started)."""
    if python is None or python == sys.executable:
        return importlib.util.find_spec(module) is not None
    prefix = os.path.dirname(os.path.dirname(python))
    return bool(glob.glob(os.path.join(prefix, "lib", "python3*", "site-packages", module)))


def _php_tag(code: str) -> str:
    """SandboxFusion's ``ensure_php_tag_in_string``: a program without ``<?php`` gets one."""
    return code if "<?php" in code else "<?php\n" + code


_JAVA_PUBLIC_CLASS = re.compile(r"public\s+(?:final\s+|abstract\s+)*class\s+(\w+)")
_SCALA_OBJECT = re.compile(r"object\s+(\w+)(\s*)|(\s+extends\s+\w+\s*){", re.DOTALL | re.MULTILINE)


def _java_public_class(code: str) -> str | None:
    """The name of the public class ``code`` declares (a JUnit test's file must be named after it)."""
    found = _JAVA_PUBLIC_CLASS.search(code)
    return found.group(1) if found else None


def _scala_object(code: str) -> str | None:
    """The first ``object`` ``code`` declares, as SandboxFusion's ``find_scala_classname`` finds it."""
    found = _SCALA_OBJECT.findall(code)
    return (found[0][0] or None) if found else None


#: C#: what ``dotnet new console``'s ``ImplicitUsings`` imports into every program (SandboxFusion's
#: programs may use ``Console`` without ``using System;``), less ``System.Net.Http`` (not installed for
#: Mono, and the sandbox has no network); mcs has no ``global using``, so they head the source
_CSHARP_USINGS = (
    "using System; using System.Collections.Generic; using System.IO; using System.Linq;"
    " using System.Threading; using System.Threading.Tasks;"
)
#: C#: ``dotnet run`` builds in Debug, where a failed ``Debug.Assert`` ends the program (``Process
#: terminated. Assertion failed.``, exit code 134: test harnesses rely on it); Mono's default listener
#: prints nothing and goes on. This listener, compiled in and named by the program's app config, fails as dotnet does.
_CSHARP_ASSERT_LISTENER = """\
public sealed class BoltzlabsAssertListener : System.Diagnostics.TraceListener
{
    public override void Write(string message) { }
    public override void WriteLine(string message) { }
    public override void Fail(string message, string detail)
    {
        System.Console.Out.Flush();
        System.Console.Error.WriteLine("Process terminated. Assertion failed.");
        System.Console.Error.WriteLine(message);
        if (!string.IsNullOrEmpty(detail)) System.Console.Error.WriteLine(detail);
        foreach (var frame in new System.Diagnostics.StackTrace(true).GetFrames())
        {
            var type = frame.GetMethod().DeclaringType;  // the program's frames: not this, not Debug's
            if (type == null || type == typeof(BoltzlabsAssertListener) || type.Namespace == "System.Diagnostics")
                continue;
            System.Console.Error.WriteLine(new System.Diagnostics.StackTrace(frame).ToString().TrimEnd());
        }
        System.Environment.Exit(134);
    }
}
"""
_CSHARP_APP_CONFIG = """\
<?xml version="1.0"?>
<configuration><system.diagnostics><trace><listeners>
  <clear/><add name="assert" type="BoltzlabsAssertListener, program"/>
</listeners></trace></system.diagnostics></configuration>
"""
#: C#: SandboxFusion's ``dotnet run`` compiles within the run step: so do we (mcs's notes to stderr). As
#: its Debug build: DEBUG defined, line numbers in stack traces (``-debug``); the implicit usings repeat a
#: program's own (CS0105, which dotnet does not report); System.Numerics is referenced, as dotnet's is.
#: ``$1`` the binary (named ``program``: the app config names its assembly), ``$2`` the source, ``$3`` the listener.
_CSHARP_RUN = 'mcs -d:DEBUG -debug -nowarn:105 -r:System.Numerics.dll -out:"$1" "$2" "$3" >&2 && exec mono --debug "$1"'
_CSHARP_PREAMBLE = re.compile(r"[ \t]*(?:#[ \t]*(?:define|undef)\b.*|//.*)?\n")


def _csharp_implicit_usings(code: str) -> str:
    """``code`` headed by :data:`_CSHARP_USINGS`: after its leading ``#define``/``#undef`` lines (which
    must precede every token), then ``#line`` so that errors and stack traces keep the program's line numbers."""
    at = 0
    while found := _CSHARP_PREAMBLE.match(code, at):
        at = found.end()
    return f"{code[:at]}{_CSHARP_USINGS}\n#line {code.count(chr(10), 0, at) + 1}\n{code[at:]}"


#: Standard headers precompiled once by ``boltzlabs-gym code-runtime install`` (``code/cpp_headers.py``)
#: into ``{runtime}/cpp/<header>.gch`` with the C++ compile's own flags; the compile searches that
#: directory first (``-I``), and GCC reads one where a program's first ``#include`` names its header
#: (and parses the header itself otherwise, or where the file is missing or stale). Read-only, and
#: holding nothing of any program: they carry nothing from one request to the next.
CPP_HEADERS = ("bits/stdc++.h", "iostream")

#: Class-data-sharing archives of the JVM tools' own classes, one per tool (``{runtime}/jvm/<name>.jsa``):
#: dumped once by ``boltzlabs-gym code-runtime install`` (``code/jvm_archives.py``) from the commands
#: below, then mapped read-only by every run. They hold the tools' parsed classes and nothing of any
#: program, so they carry nothing from one request to the next. Where one is missing or stale the JVM
#: loads the classes itself, silently (``-Xshare:auto``, its cds logging off).
JVM_ARCHIVES = ("javac", "junit", "scalac", "scala", "kotlinc")


def _jvm(archive: str, *, launcher: bool, c1: bool = False) -> tuple[str, ...]:
    """The JVM flags that map ``archive`` (:data:`JVM_ARCHIVES`); ``launcher``: as a launcher script
    takes them (``-J<flag>``: javac, scalac, kotlinc). ``c1``: a compiler's JVM, which lives a second
    or two, compiles with C1 alone (C2 would spend most of that compiling the compiler, for nothing a
    program can tell apart); a program's own JVM keeps both tiers."""
    flags: tuple[str, ...] = (f"-XX:SharedArchiveFile={{runtime}}/jvm/{archive}.jsa", "-Xlog:cds*=off")
    flags += ("-XX:TieredStopAtLevel=1",) if c1 else ()
    return tuple("-J" + flag for flag in flags) if launcher else flags


_JAVATUPLES = f"{JAVA_LIBS}/javatuples.jar"
_JUNIT = f"{JAVA_LIBS}/junit-platform-console-standalone.jar"
_GO_ENV = {"GO111MODULE": "off", "GOPATH": DEBIAN_GOPATH, "GOCACHE": "{scratch}/go-cache", "GOFLAGS": "-buildvcs=false"}
_NODE_ENV = {"NODE_PATH": "{runtime}/node/node_modules"}
#: jest's configuration (``--config``, JSON; ``{{``/``}}`` are braces): SandboxFusion's package.json and
#: babel.config.js, with the packages named by their paths in the runtime
_JEST_CONFIG = (
    '{{"rootDir": "{dir}", "testMatch": ["**/*.test.ts", "**/*.test.js"], "cacheDirectory": "{scratch}/jest",'
    ' "watchman": false, "transform": {{"\\\\.[jt]sx?$": ["{runtime}/node/node_modules/babel-jest",'
    ' {{"presets": [["{runtime}/node/node_modules/@babel/preset-env", {{"targets": {{"node": "current"}}}}],'
    ' "{runtime}/node/node_modules/@babel/preset-typescript"]}}]}}}}'
)
_RUNTIME_HINT = "boltzlabs-gym code-runtime install"

LANGUAGES: dict[str, Language] = {
    language.name: language
    for language in (
        Language("python", "main{n}.py", ("{python}", "{src}"), hint="the env's own Python"),
        Language(
            "pytest",
            "main{n}_test.py",
            ("{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "{src}"),
            runtime_needs=("py:pytest",),
            warm=True,
            hint=f"pytest in the programs' Python, the code runtime's ({_RUNTIME_HINT})",
        ),
        Language("bash", "main{n}.sh", ("/bin/bash", "{src}"), needs=("/bin/bash",), debian=("bash",)),
        Language(
            "cpp",
            "main{n}.cpp",
            ("{exe}",),
            compile=("g++", "-std=c++17", "-O2", "-I{runtime}/cpp", "{src}", "-o", "{exe}", "-lpthread"),
            needs=("g++", "/usr/include/boost/any.hpp"),
            debian=("g++", "libboost-dev"),
        ),
        Language(
            "nodejs",
            "main{n}.js",
            ("node", "{src}"),
            needs=("node",),
            env=_NODE_ENV,
            reserves_address_space=True,
            debian=("nodejs",),
        ),
        Language(
            "typescript",
            "main{n}.ts",
            ("node", "{runtime}/node/node_modules/tsx/dist/cli.mjs", "{src}"),
            needs=("node",),
            runtime_needs=("{runtime}/node/node_modules/tsx/dist/cli.mjs",),
            env={**_NODE_ENV, "TSX_DISABLE_CACHE": "1"},
            reserves_address_space=True,
            debian=("nodejs", "npm"),
            hint=f"tsx ({_RUNTIME_HINT})",
        ),
        Language(
            "jest",
            "main{n}.test.ts",
            ("node", "{runtime}/node/node_modules/jest/bin/jest.js", "--ci", "--config", _JEST_CONFIG, "{src}"),
            needs=("node",),
            runtime_needs=("{runtime}/node/node_modules/jest/bin/jest.js",),
            env={**_NODE_ENV, "FORCE_COLOR": "0"},
            reserves_address_space=True,
            debian=("nodejs", "npm"),
            hint=f"jest and babel ({_RUNTIME_HINT})",
        ),
        Language(
            "go",
            "main{n}.go",
            ("{exe}",),
            compile=("go", "build", "-o", "{exe}", "{src}"),
            needs=("go",),
            env=_GO_ENV,
            reserves_address_space=True,
            debian=("golang-go",),
        ),
        Language(
            "go_test",
            "main{n}_test.go",
            ("go", "test", "{src}"),
            needs=("go", f"{DEBIAN_GOPATH}/src/github.com/stretchr/testify/assert"),
            env=_GO_ENV,
            reserves_address_space=True,
            debian=("golang-go", "golang-github-stretchr-testify-dev"),
        ),
        Language(
            "java",
            "Main.java",
            ("java", "-cp", "{cp}", "-ea", "Main"),
            compile=("javac", *_jvm("javac", launcher=True, c1=True), "-cp", "{cp}", "-d", "{dir}", "{src}"),
            needs=("javac", "java", _JAVATUPLES),
            class_path=(_JAVATUPLES,),
            reserves_address_space=True,
            debian=("default-jdk-headless", "libjavatuples-java"),
        ),
        Language(
            "junit",
            "{main}.java",
            ("java", *_jvm("junit", launcher=False), "-jar", _JUNIT, "--disable-banner", "--disable-ansi-colors")
            + ("--class-path", "{cp}", "--scan-class-path"),
            compile=("javac", *_jvm("javac", launcher=True, c1=True), "-cp", "{cp}", "-d", "{dir}", "{src}"),
            needs=("javac", "java", _JUNIT),
            class_path=(_JUNIT,),
            find_main=lambda code: _java_public_class(code) or "Main",
            reserves_address_space=True,
            debian=("default-jdk-headless", "junit5"),
        ),
        Language(
            "php",
            "main{n}.php",
            ("php", "-f", "{src}"),
            needs=("php",),
            rewrite=_php_tag,
            debian=("php-cli",),
        ),
        Language(
            "csharp",
            "Program.cs",
            ("/bin/sh", "-c", _CSHARP_RUN, "csharp", "{exe}", "{src}", "{scratch}/BoltzlabsAssert.cs"),
            needs=("/bin/sh", "mcs", "mono", "/usr/lib/mono/4.5/System.Numerics.dll"),
            reserves_address_space=True,
            rewrite=_csharp_implicit_usings,
            support={"{scratch}/BoltzlabsAssert.cs": _CSHARP_ASSERT_LISTENER, "{exe}.config": _CSHARP_APP_CONFIG},
            debian=("mono-mcs", "mono-runtime", "libmono-system-numerics4.0-cil"),
        ),
        Language(
            "rust",
            "main{n}.rs",
            ("{exe}",),
            # linked against Debian's libstd-rust .so (the same std): half the compile's CPU, which
            # with a static std is mostly ld.bfd copying it in (rustup's newer rustc links with lld)
            compile=("rustc", "{src}", "-o", "{exe}", "-C", "prefer-dynamic"),
            needs=("rustc",),
            debian=("rustc",),
        ),
        Language("lua", "main{n}.lua", ("lua", "{src}"), needs=("lua",), debian=("lua5.4", "lua-unit")),
        Language("R", "main{n}.R", ("Rscript", "{src}"), needs=("Rscript",), debian=("r-base-core",)),
        Language(
            "perl",
            "main{n}.pl",
            ("perl", "{src}"),
            needs=("perl", "/usr/share/perl5/Test/Deep.pm", "/usr/share/perl5/Data/Compare.pm"),
            debian=("perl", "libtest-deep-perl", "libdata-compare-perl"),  # SandboxFusion's image's CPAN modules
        ),
        Language(
            "D_ut",
            "main{n}.d",
            ("{exe}",),
            compile=("ldmd2", "{src}", "-unittest", "-of={exe}", "-od={scratch}"),
            needs=("ldmd2",),
            debian=("ldc",),
        ),
        Language("ruby", "main{n}.rb", ("ruby", "{src}"), needs=("ruby",), debian=("ruby",)),
        Language(
            "scala",
            "main{n}.scala",
            ("scala", *_jvm("scala", launcher=True), "-nc", "-cp", "{dir}", "{main}"),
            compile=("scalac", *_jvm("scalac", launcher=True, c1=True), "-d", "{dir}", "{src}"),
            needs=("scalac", "scala"),
            find_main=_scala_object,
            reserves_address_space=True,
            debian=("scala",),
        ),
        Language(
            "kotlin_script",
            "main{n}.kts",
            ("kotlinc", *_jvm("kotlinc", launcher=True), "-script", "{src}"),
            needs=("kotlinc",),
            reserves_address_space=True,
            debian=("kotlin",),
        ),
        Language("racket", "main{n}.rkt", ("racket", "{src}"), needs=("racket",), debian=("racket",)),
        Language(
            "verilog",
            "main{n}.sv",
            ("vvp", "-n", "{exe}"),
            compile=("iverilog", "-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb", "-o", "{exe}", "{src}"),
            needs=("iverilog", "vvp"),
            debian=("iverilog",),
        ),
    )
}
#: Every Debian package the served languages need (``boltzlabs-gym code-languages --debian-packages``).
DEBIAN_PACKAGES = tuple(sorted({p for language in LANGUAGES.values() for p in language.debian}))
#: SandboxFusion's names for the same runners (its ``js`` and ``ts``).
ALIASES = {"js": "nodejs", "ts": "typescript"}
#: Languages SandboxFusion names that no runner here serves, and why.
NOT_SERVED = {
    "sql": "SandboxFusion names it but has no runner for it",
    "julia": "no Julia in Debian 12",
    "lean": "Lean 4 and its lake packages come from elan and GitHub, not a package registry",
    "swift": "no Swift compiler in Debian 12",
    "cuda": "needs a GPU",
    "python_gpu": "needs a GPU",
}


def runtime_python(runtime: str) -> str:
    """The code runtime's interpreter, which programs run under where it is installed."""
    return os.path.join(runtime, "python", "bin", "python")


def availability(runtime: str = DEFAULT_RUNTIME, path: str = PATH, python: str | None = None) -> dict[str, str | None]:
    """Each language -> ``None`` where it runs here, else why not (the missing toolchain and what
    installs it). ``python``: the interpreter Python programs run under (default: this one)."""
    out: dict[str, str | None] = {}
    for name, language in LANGUAGES.items():
        if name == "python":
            out[name] = None
            continue
        out[name] = language.why_not(path, runtime, python)
    for name, why in NOT_SERVED.items():
        out[name] = why
    return out
