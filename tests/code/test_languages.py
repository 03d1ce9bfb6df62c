"""Every language the code runner serves, run for real in its sandbox: a program that works, one that
fails, one that does not compile (compiled languages), the test frameworks' passing and failing
tests, the libraries SandboxFusion's runtime gives programs, deadlines, memory limits for runtimes
that reserve large address spaces, and the answer for a missing toolchain. Each under the wipe (the
default) and without it (``wipe=False``), where every program runs in namespaces made for it alone
and no env is hard-reset.

A language whose toolchain this host lacks is skipped, naming what is missing (`.ci/run` installs
them all: `boltzlabs-gym code-languages --debian-packages`, `boltzlabs-gym code-runtime install`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from boltzlabs_gym.code import CodeRunner
from boltzlabs_gym.code.languages import SERVED

#: language -> (a program that prints "hi", one that fails at run time)
PROGRAMS = {
    "python": ('print("hi")', "raise SystemExit(3)"),
    "pytest": ("def test_ok():\n    print('hi')\n    assert 1 + 1 == 2\n", "def test_bad():\n    assert 1 + 1 == 3\n"),
    "bash": ("echo hi", "exit 3"),
    "cpp": (
        '#include <iostream>\nint main() { std::cout << "hi" << std::endl; }',
        "#include <cstdlib>\nint main() { return 3; }",
    ),
    "nodejs": ('console.log("hi")', "process.exit(3)"),
    "typescript": ('const s: string = "hi";\nconsole.log(s);', 'const n: number = 3;\nthrow new Error("boom " + n);'),
    "jest": (
        'import { expect, test } from "@jest/globals";\n'
        "const add = (a: number, b: number): number => a + b;\n"
        'test("adds", () => { console.log("hi"); expect(add(1, 2)).toBe(3); });',
        'import { expect, test } from "@jest/globals";\ntest("adds", () => { expect(1 + 2).toBe(4); });',
    ),
    "go": (
        'package main\nimport "fmt"\nfunc main() { fmt.Println("hi") }',
        'package main\nimport "os"\nfunc main() { os.Exit(3) }',
    ),
    "go_test": (
        'package main\nimport (\n"fmt"\n"testing"\n"github.com/stretchr/testify/assert"\n)\n'
        'func TestAdd(t *testing.T) { fmt.Println("hi"); assert.Equal(t, 3, 1+2) }',
        'package main\nimport (\n"testing"\n"github.com/stretchr/testify/assert"\n)\n'
        "func TestAdd(t *testing.T) { assert.Equal(t, 4, 1+2) }",
    ),
    "java": (
        'public class Main { public static void main(String[] a) { System.out.println("hi"); } }',
        "public class Main { public static void main(String[] a) { System.exit(3); } }",
    ),
    "junit": (
        "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
        'public class AddTest { @Test void adds() { System.out.println("hi"); assertEquals(3, 1 + 2); } }',
        "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
        "public class AddTest { @Test void adds() { assertEquals(4, 1 + 2); } }",
    ),
    "php": ('<?php\necho "hi\\n";', "<?php\nexit(3);"),
    "csharp": (
        'using System;\nclass P { static void Main() { Console.WriteLine("hi"); } }',
        "using System;\nclass P { static int Main() { return 3; } }",
    ),
    "rust": ('fn main() { println!("hi"); }', "fn main() { std::process::exit(3); }"),
    "lua": ('print("hi")', "os.exit(3)"),
    "R": ('cat("hi\\n")', "quit(status = 3)"),
    "perl": ('print "hi\\n";', "exit 3;"),
    "D_ut": (
        'import std.stdio;\nvoid main() { writeln("hi"); }',  # (with unittests, druntime runs only them)
        "unittest { assert(1 + 2 == 4); }\nvoid main() {}",
    ),
    "ruby": ('puts "hi"', "exit 3"),
    "scala": (
        'object Main { def main(args: Array[String]): Unit = println("hi") }',
        "object Main { def main(args: Array[String]): Unit = sys.exit(3) }",
    ),
    "kotlin_script": ('println("hi")', "kotlin.system.exitProcess(3)"),
    "racket": ('#lang racket\n(displayln "hi")', "#lang racket\n(exit 3)"),
    "verilog": (
        'module tb; initial begin $display("hi"); $finish; end endmodule',
        'module tb; initial begin $fatal(1, "boom"); end endmodule',
    ),
}
#: language -> a program that does not compile (the compiled languages: the run never starts)
BROKEN = {
    "cpp": "int main() { return undefined_name; }",
    "go": "package main\nfunc main() { undefined_name() }",
    "java": "public class Main { public static void main(String[] a) { undefined_name(); } }",
    "junit": "public class AddTest { void t() { undefined_name(); } }",
    "rust": "fn main() { undefined_name(); }",
    "D_ut": "void main() { undefined_name(); }",
    "scala": "object Main { def main(args: Array[String]): Unit = undefinedName() }",
    "verilog": "module tb; initial begin undefined_task(); end endmodule",
}
#: the test frameworks: their "hi" is a passing test (which says so this way), their failure a failing one
PASSED = {"pytest": "1 passed", "jest": "1 passed", "go_test": "ok  ", "junit": "1 tests successful"}
FRAMEWORKS = {*PASSED, "D_ut"}
SLOW = {"java", "junit", "scala", "kotlin_script", "csharp"}  # JVMs and Mono: seconds of CPU each


@pytest.fixture(scope="module", params=[True, False], ids=["wipe", "fresh"])
def runner(request):
    wipe = request.param
    with CodeRunner(envs_per_lane=2, lanes=1, max_run_timeout=60, max_compile_timeout=60, wipe=wipe) as r:
        if not wipe and r.fresh_unavailable is not None:
            pytest.skip(f"no fresh namespaces per program under {r.isolation.backend}: {r.fresh_unavailable}")
        yield r
        if not wipe:  # every program, of every language, ran in its own namespaces: none was followed by a hard reset
            stats = r.stats()
            assert stats.hard_resets == 0 and stats.fresh == sum(stats.runs.values()), stats


def _needs(runner, language):
    why = runner.languages.get(language)
    if why is not None:
        pytest.skip(f"{language} cannot run on this host: {why}")


def test_every_served_language_has_programs_here():
    assert set(PROGRAMS) == set(SERVED)


@pytest.mark.parametrize("language", sorted(PROGRAMS))
def test_a_working_program_succeeds(runner, language):
    _needs(runner, language)
    result = runner.run(PROGRAMS[language][0], language=language, run_timeout=60, compile_timeout=60)
    assert result.status == "Success", (result.message, result.stderr[-2000:])
    assert result.run_result.return_code == 0
    if language in PASSED:  # a test framework: its own summary of one passing test
        assert PASSED[language] in result.stdout + result.stderr, (result.stdout, result.stderr)
    else:
        assert result.stdout.splitlines()[0] == "hi"


@pytest.mark.parametrize("language", sorted(PROGRAMS))
def test_a_failing_program_fails_with_its_status(runner, language):
    _needs(runner, language)
    result = runner.run(PROGRAMS[language][1], language=language, run_timeout=60, compile_timeout=60)
    assert result.status == "Failed", (result.message, result.stderr[-2000:])
    assert result.run_result is not None and result.run_result.status == "Finished"
    assert result.run_result.return_code != 0
    if language not in FRAMEWORKS and language not in ("typescript", "verilog"):
        assert result.run_result.return_code == 3


@pytest.mark.parametrize("language", sorted(BROKEN))
def test_a_program_that_does_not_compile_never_runs(runner, language):
    _needs(runner, language)
    result = runner.run(BROKEN[language], language=language, run_timeout=60, compile_timeout=60)
    assert result.status == "Failed"
    assert result.compile_result is not None and result.compile_result.status == "Finished"
    assert result.compile_result.return_code != 0 and result.run_result is None
    assert "undefined" in result.stderr.lower() or "not found" in result.stderr.lower()


def test_the_runtime_libraries_programs_expect(runner):
    """SandboxFusion's image gives C++ Boost, Java javatuples, Lua luaunit, Perl's Test::Deep and
    Data::Compare, and Node's lodash; MultiPL-E's programs use them."""
    programs = {
        "cpp": '#include <boost/any.hpp>\n#include <iostream>\nint main() { boost::any a = 7; std::cout << boost::any_cast<int>(a) << "\\n"; }',
        "java": "import org.javatuples.Pair;\npublic class Main { public static void main(String[] a) { "
        'System.out.println(Pair.with(7, "x").getValue0()); } }',
        "lua": 'local lu = require("luaunit")\nlu.assertEquals(7, 7)\nprint(7)',
        "perl": 'use Test::Deep; use Data::Compare;\nprint Compare([7], [7]) ? 7 : 0, "\\n";',
        "nodejs": 'const _ = require("lodash");\nconsole.log(_.sum([3, 4]));',
    }
    for language, code in programs.items():
        if runner.languages.get(language) is not None:
            continue
        result = runner.run(code, language=language, run_timeout=60, compile_timeout=60)
        assert result.status == "Success" and result.stdout.strip() == "7", (language, result.stderr[-2000:])
    if all(runner.languages.get(lang) is not None for lang in programs):
        pytest.skip("none of cpp, java, lua, perl, nodejs can run on this host")


@pytest.mark.parametrize("language", ["bash", "go", "java"])
def test_a_deadline_kills_the_program_and_its_children(runner, language):
    _needs(runner, language)
    forever = {
        "bash": "sleep 100 & sleep 100",
        "go": 'package main\nimport ("os/exec"\n"time")\nfunc main() { exec.Command("sleep", "100").Start(); time.Sleep(100 * time.Second) }',
        "java": "public class Main { public static void main(String[] a) throws Exception { "
        'new ProcessBuilder("sleep", "100").start(); Thread.sleep(100000); } }',
    }[language]
    t0 = time.monotonic()
    result = runner.run(forever, language=language, run_timeout=2, compile_timeout=60)
    assert result.status == "Failed" and result.run_result.status == "TimeLimitExceeded"
    assert time.monotonic() - t0 < 40
    # the next program in the same envs finds no sleep left behind
    for _ in range(runner.capacity):
        left = runner.run("ps -eo comm | grep -c '^sleep$' || true", language="bash")
        assert left.stdout.strip() == "0", left.stdout


def test_a_jvm_runs_under_a_memory_limit_that_its_address_space_exceeds(runner):
    """A JVM reserves gigabytes of address space it never touches: the limit bounds what it uses."""
    _needs(runner, "java")
    hello = PROGRAMS["java"][0]
    result = runner.run(hello, language="java", memory_limit_mb=768, run_timeout=60, compile_timeout=60)
    assert result.status == "Success", result.stderr[-2000:]


def test_a_go_program_over_its_memory_limit_fails(runner):
    _needs(runner, "go")
    hog = (
        'package main\nimport "fmt"\nfunc main() { b := make([]byte, 1<<30)\n'
        "for i := range b { b[i] = 1 }\nfmt.Println(len(b)) }"
    )
    result = runner.run(hog, language="go", memory_limit_mb=256, run_timeout=30, compile_timeout=60)
    assert result.status == "Failed" and "1073741824" not in result.stdout
    fits = runner.run(hog.replace("1<<30", "1<<20"), language="go", memory_limit_mb=256, compile_timeout=60)
    assert fits.status == "Success" and fits.stdout.strip() == "1048576", fits.stderr[-2000:]


def test_sandboxfusions_quirks(runner):
    """PHP without its tag runs; a Scala program without an object is SandboxFusion's SandboxError;
    ``js`` and ``ts`` are its other names for nodejs and typescript."""
    if runner.languages.get("php") is None:
        assert runner.run('echo "hi";', language="php").stdout == "hi"
    if runner.languages.get("scala") is None:
        result = runner.run("class NoObject", language="scala")
        assert result.status == "SandboxError" and result.message == "Object name not found."
    if runner.languages.get("nodejs") is None:
        assert runner.run('console.log("hi")', language="js").stdout == "hi\n"
    if runner.languages.get("D_ut") is None:  # unittests run, main does not (druntime's test-or-main)
        tested = runner.run(
            'import std.stdio;\nunittest { assert(1 + 2 == 3); }\nvoid main() { writeln("main"); }', language="D_ut"
        )
        assert tested.status == "Success" and "1 modules passed unittests" in tested.stdout + tested.stderr


def test_a_missing_toolchain_answers_sandbox_error_naming_it():
    """Where the code runtime is not installed, a TypeScript program is a SandboxError that names
    the missing tsx and the command that installs it; the start-up report says the same."""
    runtime = "/usr/nonexistent-boltzlabs-runtime"
    with CodeRunner(envs_per_lane=1, lanes=1, env_vars={"BOLTZLABS_CODE_RUNTIME": runtime}) as r:
        assert r.languages["typescript"] is not None and "code-runtime install" in r.languages["typescript"]
        result = r.run('console.log("hi")', language="typescript")
        assert result.status == "SandboxError"
        assert f"{runtime}/node/node_modules/tsx" in result.message and "code-runtime install" in result.message
        assert r.run("print(1)").stdout == "1\n"  # the env is still fine


def test_the_languages_command_lists_each_language_and_why_not():
    # (in a process of its own: the command line restores SIGPIPE's default action, as CLI tools do)
    def command(*args):
        done = subprocess.run([sys.executable, "-m", "boltzlabs_gym.cli", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    found = json.loads(command("code-languages", "--json"))
    assert set(SERVED) <= set(found) and found["python"] is None
    assert found["swift"] == "no Swift compiler in Debian 12"
    assert "g++" in command("code-languages", "--debian-packages").split()
