"""Speed per language: correct runs/s of a trivial program in every served language, against SandboxFusion.

    # SandboxFusion set up by ../shared/tools/sandboxfusion/setup.sh in /work/sf, started beforehand:
    #   cd / && SF_HOME=/work/sf /work/sf/start.sh 8090
    python benchmarks/code_languages.py --sandboxfusion http://127.0.0.1:8090 --sandboxfusion-home /work/sf \\
        --mirror-sandboxfusion-runtime --record code-languages-DATE
    # some languages, shorter
    python benchmarks/code_languages.py --languages python,cpp,java --seconds 5 --sandboxfusion http://127.0.0.1:8090
    # a smoke run (seconds): python, bash and verilog (a compile step), one 1.5 s round each
    python benchmarks/code_languages.py --smoke --servers ours,subprocess

Each language sends one trivial program that reads nothing and prints a known line (the test-framework
languages, pytest, go_test, junit and jest, run one passing test and their report is matched instead).
A run counts as correct only when the reply's status is ``Success`` and its stdout matches; the
figure is correct runs per second in the timed window (code_server.py's ``measure_round``: the
window opens once every client has had its first answer, and counts the runs that end within it).

Concurrency per language (:data:`CONCURRENCY`), the number of client threads posting back to back:
  64  interpreters and what runs like one (python, pytest, bash, nodejs, typescript, php, lua, R,
      perl, ruby, racket, verilog): tens of ms of CPU and tens of MiB per run, so 64 in flight keep
      both cores busy without putting the machine in swap; verl's reward workers send that many.
  8   compilers to native code (cpp, rust, go, go_test, D_ut) and jest (babel compiles every test):
      0.2-1 s of CPU and 100-300 MiB per run; 8 already queue 4 per core, more only measures the queue.
  4   JVM and .NET languages (java, junit, scala, kotlin_script, csharp): a JVM compiler and a JVM run,
      0.2-0.5 GiB and seconds of CPU each; 4 of them fill 2 cores, 64 would only swap.
Each language runs for its own window (:data:`SECONDS`, ``--seconds`` overrides it), longer where
runs take seconds, so that a window holds tens of runs, and several per client: 30 s for the
interpreters of 0.2 s of CPU or more per run (pytest, typescript, R, racket), whose answers take 6-15 s
at 64 at once.

Systems (``--servers``), each measured in ``--rounds`` rounds per language, taking turns in an order
rotated every round (code_server.py's ``measure_cell``):
  ours           ``boltzlabs-gym code-server`` as its users start it: the console script of
                 ``--python``'s environment, cwd ``/``, default settings (4 lanes x 4 envs, sandboxed,
                 wiped in place after every run where the sandbox allows it, else hard-reset)
  sandboxfusion  SandboxFusion at ``--sandboxfusion URL``, started beforehand (isolation none: a temp dir
                 and ``bash -c`` per request, toolchains from its server's PATH). Which of its toolchains
                 exist is asked of it (its bash runner runs ``command -v`` for each) and printed.
  subprocess     a thread per client running the same toolchain commands as ours (the language table,
                 runner_env/_languages.py) with ``subprocess.run``, in a fresh temp dir per run: no
                 sandbox, no HTTP, no memory limit
Python programs (python, pytest) run on the server's own interpreter by default (``--python worker``),
with every package the project's extras installed there; pytest's cost per run grows with every installed
plugin and with the distributions its entry-point scan reads. ``--mirror-sandboxfusion-runtime`` makes a
venv with SandboxFusion's runtime venv's interpreter and ``pip freeze`` (under /usr/local/lib, which a
worker accepts and every sandbox shows) and runs ours' Python programs on it: the same packages on
both sides. ``--programs-python PATH`` names such an interpreter directly.
Before it is timed, every system gets one run of the language: a system that cannot run it (its
toolchain missing, a wrong answer) is not timed there, and the table says why.

``--record NAME`` writes benchmarks/results/NAME.md and NAME.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import code_server as cs  # noqa: E402
import code_server_setups as setups  # noqa: E402
import code_workloads as workloads  # noqa: E402

from boltzlabs_gym.code.languages import _TABLE  # noqa: E402  (the table ours runs: commands, env, file names)

SERVERS = ("ours", "sandboxfusion", "subprocess")
#: ours runs Python programs (python, pytest) under the benchmark's interpreter, as the subprocess
#: baseline does and as SandboxFusion's runtime venv here does (the same pyenv build): by default it
#: would take the code runtime's venv (Debian's Python), and the rows would compare interpreter builds
SAME_PYTHON = ["--python", "worker"]
#: where ``--mirror-sandboxfusion-runtime`` makes its venv: under /usr, which a worker accepts for
#: programs and every sandbox shows (read-only)
MIRROR_VENV = "/usr/local/lib/boltzlabs-bench/sandboxfusion-runtime-mirror"
SMOKE_LANGUAGES = ("python", "bash", "verilog")  # verilog: a compile step that takes ms, not seconds
RUN_TIMEOUT = 20.0  # per step: generous, so that a JVM under load is not cut off
COMPILE_TIMEOUT = 30.0


@dataclass(frozen=True)
class Program:
    """A trivial program and what its stdout must be (``re.fullmatch`` on the stripped stdout, DOTALL)."""

    code: str
    stdout: str

    def matches(self, out: str | None) -> bool:
        return re.fullmatch(self.stdout, (out or "").strip(), re.DOTALL) is not None


def _says(line: str) -> str:
    return re.escape(line)


HELLO = "hello from {}"
PROGRAMS: dict[str, Program] = {
    "python": Program('print("hello from python")\n', _says(HELLO.format("python"))),
    "pytest": Program("def test_sum():\n    assert 1 + 1 == 2\n", r".*\b1 passed\b.*"),
    "bash": Program('echo "hello from bash"\n', _says(HELLO.format("bash"))),
    "cpp": Program(
        '#include <iostream>\nint main() { std::cout << "hello from cpp" << std::endl; return 0; }\n',
        _says(HELLO.format("cpp")),
    ),
    "nodejs": Program('console.log("hello from nodejs");\n', _says(HELLO.format("nodejs"))),
    "typescript": Program(
        'const who: string = "typescript";\nconsole.log(`hello from ${who}`);\n', _says(HELLO.format("typescript"))
    ),
    # jest reports on stderr; the test writes its line to stdout itself (SandboxFusion's `npm run test` adds
    # npm's own header lines there)
    "jest": Program(
        'test("sum", () => {\n  process.stdout.write("hello from jest\\n");\n  expect(1 + 1).toBe(2);\n});\n',
        r".*hello from jest.*",
    ),
    "go": Program(
        'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("hello from go")\n}\n', _says(HELLO.format("go"))
    ),
    "go_test": Program(
        'package main\n\nimport "testing"\n\n'
        'func TestSum(t *testing.T) {\n\tif 1+1 != 2 {\n\t\tt.Fatal("sum")\n\t}\n}\n',
        r"(?:.*\n)?ok\s.*",
    ),
    "java": Program(
        "public class Main {\n    public static void main(String[] args) {\n"
        '        System.out.println("hello from java");\n    }\n}\n',
        _says(HELLO.format("java")),
    ),
    "junit": Program(
        "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.assertEquals;\n\n"
        "public class SumTest {\n    @Test\n    void sum() {\n        assertEquals(2, 1 + 1);\n    }\n}\n",
        r".*\b1 tests successful\b.*",
    ),
    "php": Program('<?php\necho "hello from php\\n";\n', _says(HELLO.format("php"))),
    "csharp": Program(
        'using System;\n\nclass Program {\n    static void Main() {\n        Console.WriteLine("hello from csharp");\n'
        "    }\n}\n",
        _says(HELLO.format("csharp")),
    ),
    "rust": Program('fn main() {\n    println!("hello from rust");\n}\n', _says(HELLO.format("rust"))),
    "lua": Program('print("hello from lua")\n', _says(HELLO.format("lua"))),
    "R": Program('cat("hello from R\\n")\n', _says(HELLO.format("R"))),
    "perl": Program('print "hello from perl\\n";\n', _says(HELLO.format("perl"))),
    # D_ut compiles with -unittest: druntime runs the unittests and then, by default, not main
    "D_ut": Program(
        'import std.stdio;\n\nunittest {\n    assert(1 + 1 == 2);\n    writeln("hello from D_ut");\n}\n\n'
        "void main() {}\n",
        _says(HELLO.format("D_ut")),
    ),
    "ruby": Program('puts "hello from ruby"\n', _says(HELLO.format("ruby"))),
    "scala": Program(
        'object Main {\n  def main(args: Array[String]): Unit = println("hello from scala")\n}\n',
        _says(HELLO.format("scala")),
    ),
    "kotlin_script": Program('println("hello from kotlin_script")\n', _says(HELLO.format("kotlin_script"))),
    "racket": Program('#lang racket/base\n(displayln "hello from racket")\n', _says(HELLO.format("racket"))),
    "verilog": Program(
        'module tb;\n  initial begin\n    $display("hello from verilog");\n  end\nendmodule\n',
        _says(HELLO.format("verilog")),
    ),
}

INTERPRETED, COMPILED, JVM = 64, 8, 4
CONCURRENCY: dict[str, int] = {
    **dict.fromkeys(
        ("python", "pytest", "bash", "nodejs", "typescript", "php", "lua", "R", "perl", "ruby", "racket", "verilog"),
        INTERPRETED,
    ),
    **dict.fromkeys(("cpp", "rust", "go", "go_test", "D_ut", "jest"), COMPILED),
    **dict.fromkeys(("java", "junit", "scala", "kotlin_script", "csharp"), JVM),
}
SECONDS: dict[str, float] = {lang: {INTERPRETED: 8.0, COMPILED: 15.0, JVM: 30.0}[c] for lang, c in CONCURRENCY.items()}
# Interpreters whose trivial run takes 0.2 s of CPU or more: at 64 at once on 2 cores an answer takes
# 6-15 s, so an 8 s window holds about one answer per client, all in phase (the window opens once every
# client has had its first), and counts runs in multiples of 64. 30 s holds several per client.
SECONDS.update(dict.fromkeys(("pytest", "typescript", "R", "racket"), 30.0))
# What SandboxFusion's runners call (sandbox/runners/major.py, minor.py), asked of its own bash runner.
SF_TOOLS = (
    "python", "pytest", "g++", "node", "tsx", "npm", "go", "javac", "java", "php", "dotnet", "rustc", "lua",
    "Rscript", "perl", "dmd", "ruby", "scalac", "scala", "kotlin", "racket", "iverilog", "vvp",
)  # fmt: skip

assert set(PROGRAMS) == set(CONCURRENCY) == set(_TABLE.LANGUAGES), "a program and a concurrency per served language"


# --------------------------------------------------------------------------- how each system runs a program
def _verdict(status: str | None, stdout: str | None, program: Program) -> str:
    """``Success`` only for status Success with the expected stdout; else what went wrong, briefly."""
    if status == "Success" and not program.matches(stdout):
        return "Success, wrong stdout"
    return status or "no status"


def via_server(url: str, detail: dict | None = None) -> cs.RunFn:
    """Post each job (``job.name``: its language) to ``url``/run_code, one keep-alive connection per client.

    ``detail``: where the last reply of each language is kept (the probe reads it to say why a run failed).
    """
    parts = urlsplit(url)
    local = threading.local()

    def run(job: workloads.Job) -> cs.Outcome:
        body = {"code": job.code, "language": job.name, "run_timeout": RUN_TIMEOUT, "compile_timeout": COMPILE_TIMEOUT}
        for attempt in range(2):
            conn = getattr(local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = local.conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=300)
            try:
                conn.request("POST", "/run_code", json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                break
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                local.conn = None
                # a keep-alive connection the server closed while it sat idle (uvicorn's 5 s): once more
                if not (reused and attempt == 0):
                    return cs.Outcome(f"HTTP error {type(e).__name__}")
        if resp.status != 200:
            return cs.Outcome(f"HTTP {resp.status}")
        try:
            reply = json.loads(data)
        except ValueError:
            return cs.Outcome("not JSON")
        if detail is not None:
            detail[job.name] = reply
        stdout = (reply.get("run_result") or {}).get("stdout")
        return cs.Outcome(_verdict(reply.get("status"), stdout, PROGRAMS[job.name]))

    return run


def via_subprocess(runtime: str, detail: dict | None = None, python: str = sys.executable) -> cs.RunFn:
    """The language table's compile and run commands, by ``subprocess.run``, in a fresh temp dir per run
    (Python programs on ``python``: the benchmark's, or ours' programs' interpreter when one is named)."""

    def run(job: workloads.Job) -> cs.Outcome:
        spec = _TABLE.LANGUAGES[job.name]
        code = spec.rewrite(job.code) if spec.rewrite else job.code
        main = spec.main_of(code) or "Main"
        with tempfile.TemporaryDirectory(prefix="lang-bench-") as workspace:
            scratch = os.path.join(workspace, ".scratch")
            os.mkdir(scratch)
            names = spec.placeholders(workspace, scratch, runtime, python, main)
            names["src"] = os.path.join(workspace, spec.source.format(n="", main=main))
            with open(names["src"], "w") as f:
                f.write(code)
            for path, text in spec.support.items():  # (C#'s assert listener, as the env writes it)
                with open(path.format(**names), "w") as f:
                    f.write(text)
            env = {"PATH": _TABLE.PATH, "LANG": "C.UTF-8", "HOME": workspace}
            env.update({k: v.format(**names) for k, v in spec.env.items()})
            steps = ([(spec.compile, COMPILE_TIMEOUT)] if spec.compile else []) + [(spec.run, RUN_TIMEOUT)]
            for command, timeout in steps:
                try:
                    p = subprocess.run(
                        [part.format(**names) for part in command],
                        cwd=workspace,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                    )
                except subprocess.TimeoutExpired:
                    return cs.Outcome("Failed")
                except OSError as e:
                    if detail is not None:
                        detail[job.name] = {"error": str(e)}
                    return cs.Outcome("Failed")
                if detail is not None:
                    detail[job.name] = {
                        "return_code": p.returncode,
                        "stdout": p.stdout[-500:],
                        "stderr": p.stderr[-500:],
                    }
                if p.returncode != 0:
                    return cs.Outcome("Failed")
        return cs.Outcome(_verdict("Success", p.stdout, PROGRAMS[job.name]))

    return run


@dataclass
class System:
    """A system under measurement (a code_server.py ``Target``) and the last reply per language."""

    target: cs.Target
    detail: dict


def start_ours(python: str, port: int, log_dir: str, programs_python: str | None = None) -> cs.Target:
    """``boltzlabs-gym code-server`` from ``python``'s environment, as its users start it (cwd ``/``),
    but for ``--python worker`` (:data:`SAME_PYTHON`), or ``--python programs_python`` when given."""
    script = os.path.join(os.path.dirname(python), "boltzlabs-gym")
    cmd = [script, "code-server", "--port", str(port)] if os.path.exists(script) else None
    if cmd is None:
        cmd = [python, "-m", "boltzlabs_gym.cli", "code-server", "--port", str(port)]
    cmd += ["--python", programs_python] if programs_python else SAME_PYTHON
    url, proc, log_path = cs.launch_server(cmd, "ours", port, log_dir, cwd="/", timeout=180)
    return cs.Target("ours", None, url=url, wipe=True, proc=proc, log_path=log_path)


def why_failed(system: System, language: str, verdict: str) -> str:
    """A line on why ``system``'s probe run of ``language`` was not correct: its status and stderr's end."""
    reply = system.detail.get(language) or {}
    run = reply.get("run_result") or {}
    comp = reply.get("compile_result") or {}
    parts = [verdict]
    if reply.get("message"):
        parts.append(str(reply["message"]))
    for what, res in (("compile", comp), ("run", run), ("", reply)):
        err = (res.get("stderr") or res.get("error") or "").strip()
        if err:
            parts.append(f"{what} stderr: " + " | ".join(err.splitlines()[-2:]))
            break
    if verdict == "Success, wrong stdout":
        parts.append(f"stdout {(run or reply).get('stdout', '')[:120]!r}")
    return "; ".join(parts)[:300]


def sandboxfusion_tools(url: str) -> dict[str, str]:
    """Each command SandboxFusion's runners call -> where it finds it, or ``MISSING``.

    Its bash runner answers for all but the python runner's own two, whose PATH puts the runtime venv
    first: ``python`` and ``pytest`` are asked of that runner (``python``/``pytest`` in the keys).
    """
    code = "for t in " + " ".join(SF_TOOLS) + '; do printf "%s " "$t"; command -v "$t" || echo MISSING; done\n'
    probe_py = (
        'import shutil, sys\nprint("python", sys.executable)\nprint("pytest", shutil.which("pytest") or "MISSING")\n'
    )
    found = {}
    for language, program in (("bash", code), ("python", probe_py)):
        detail: dict = {}
        via_server(url, detail)(workloads.Job(program, RUN_TIMEOUT, "Success", language))
        out = ((detail.get(language) or {}).get("run_result") or {}).get("stdout") or ""
        found.update(line.split(" ", 1) for line in out.splitlines() if " " in line)
    return found


# --------------------------------------------------------------------------- one language
def measure_language(systems: list[System], language: str, args) -> dict:
    """Probe every system with one run, then time those that answered right (``measure_cell``'s rounds)."""
    program = PROGRAMS[language]
    job = workloads.Job(program.code, RUN_TIMEOUT, "Success", language)
    concurrency = CONCURRENCY[language]
    seconds = args.seconds if args.seconds is not None else SECONDS[language]
    cannot: dict[str, str] = {}
    timed = []
    for system in systems:
        verdict = system.target.run(job).status
        if verdict == "Success":
            timed.append(system)
        else:
            cannot[system.target.name] = why_failed(system, language, verdict)
            cs.log(f"{language}: {system.target.name} cannot run it: {cannot[system.target.name]}")
    rounds: list[cs.Round] = []
    counts: dict = {}
    if timed and not args.probe_only:
        cell_args = argparse.Namespace(rounds=args.rounds, seconds=seconds)
        rounds, counts = cs.measure_cell([s.target for s in timed], language, concurrency, [job], cell_args)
    rows = {}
    for system in systems:
        name = system.target.name
        rs = [r for r in rounds if r.server == name]
        rows[name] = {
            "correct_per_s": cs.spread([r.timed_right / r.seconds for r in rs]),
            "runs_per_s": cs.spread([r.runs_per_s for r in rs]),
            "p50_ms": cs.pick([x for r in rs for x in r.latencies_ms], 0.5) if rs else None,
            "right": sum(r.right for r in rs),
            "checked": sum(r.checked for r in rs),
            "statuses": dict(sum((Counter(r.statuses) for r in rs), Counter())),
            "cannot": cannot.get(name),
        }
    ratio = ratios(rounds, "ours", "sandboxfusion")
    flags = [
        f"{name} answered {row['checked'] - row['right']} of {row['checked']} runs of {language} wrong"
        f" (statuses {row['statuses']})"
        for name, row in rows.items()
        if row["right"] != row["checked"]
    ]
    for name, c in counts.items():
        if c.get("hard_resets"):
            flags.append(f"{name} hard-reset {c['hard_resets']} of {c['wipes'] + c['hard_resets']} runs of {language}")
    return {
        "language": language,
        "concurrency": concurrency,
        "seconds": seconds,
        "rows": rows,
        "ours_vs_sandboxfusion": ratio,
        "our_counts": counts,
        "flags": flags,
        "rounds": [r.to_json() for r in rounds],
    }


def ratios(rounds: list[cs.Round], a: str, b: str) -> dict:
    """``a``'s correct runs/s over ``b``'s, round by round (median, range); empty where ``b`` made none."""
    by = {(r.server, r.round): r.timed_right for r in rounds}
    xs = [by[(a, i)] / by[(b, i)] for (s, i) in by if s == a and by.get((b, i))]
    return cs.spread(xs)


# --------------------------------------------------------------------------- the report
def fmt_rate(row: dict) -> str:
    if row["cannot"]:
        return "cannot run (see below)"
    return cs.fmt_spread(row["correct_per_s"]) if row["correct_per_s"] else "runs (not timed)"


def fmt_ratio(cell: dict) -> str:
    rows = cell["rows"]
    if "ours" not in rows or "sandboxfusion" not in rows:
        return "-"
    if rows["sandboxfusion"]["cannot"]:
        return "SF cannot run it" if not rows["ours"]["cannot"] else "-"
    return cs.fmt_spread(cell["ours_vs_sandboxfusion"], ".2f", "x") if cell["ours_vs_sandboxfusion"] else "-"


def table(cells: list[dict], servers: list[str]) -> list[str]:
    names = {"ours": "ours", "sandboxfusion": "SandboxFusion", "subprocess": "subprocess"}
    out = [
        "| language | concurrency | " + " | ".join(f"{names[s]} runs/s" for s in servers) + " | ours/SF |",
        "|---|---:|" + "---:|" * len(servers) + "---:|",
    ]
    for cell in cells:
        rates = " | ".join(fmt_rate(cell["rows"][s]) for s in servers)
        out.append(f"| {cell['language']} | {cell['concurrency']} | {rates} | {fmt_ratio(cell)} |")
    return out


def report(args, result: dict) -> str:
    h = result["header"]
    lines = ["# Speed per language: ours against SandboxFusion and a subprocess pool", ""]
    lines += cs.header_lines(h)
    lines += [f"- `date -u`: {h['date_u']}", f"- load average at the end: {' '.join(map(str, result['load_end']))}"]
    lines += ["", "## Setup", ""] + [f"- {line}" for line in result["setup_lines"]]
    lines += [
        "",
        "## Correct runs per second",
        "",
        f"A trivial program per language (one printed line, or one passing test); {args.rounds} round(s) per"
        " language, the systems taking turns; runs/s: median over rounds (range) of the runs that ended"
        " in the timed window with status Success and the expected stdout. ours/SF: per-round ratio.",
        "",
    ]
    lines += table(result["cells"], result["servers"])
    cannot = [(c["language"], s, r["cannot"]) for c in result["cells"] for s, r in c["rows"].items() if r["cannot"]]
    if cannot:
        lines += ["", "## Not run", ""] + [f"- {lang}, {s}: {why}" for lang, s, why in cannot]
    details = [
        f"| {c['language']} | {s} | {cs.fmt_spread(r['runs_per_s'])} | {r['right']}/{r['checked']}"
        f" | {r['p50_ms']:.0f} |"
        for c in result["cells"]
        for s, r in c["rows"].items()
        if not r["cannot"] and r["checked"]
    ]
    lines += [
        "",
        "## Every run",
        "",
        "| language | system | all runs/s | correct/runs | p50 ms |",
        "|---|---|---:|---:|---:|",
    ]
    lines += details
    if result["flags"]:
        lines += ["", "## !!! Flags", ""] + [f"- !!! {f}" for f in result["flags"]]
    return "\n".join(lines) + "\n"


def mirror_sandboxfusion_runtime(home: str, target: str = MIRROR_VENV) -> str:
    """A venv at ``target`` with what SandboxFusion's runtime venv (``home``/runtime-venv) has: the
    same base interpreter and the same ``pip freeze``, so that ours runs Python programs (python,
    pytest) with the packages SandboxFusion's run with (pytest's cost per run depends on every
    installed plugin and on how many distributions its entry-point scan reads). Made afresh each
    time; returns its python."""
    runtime = os.path.join(home, "runtime-venv", "bin", "python")
    base = subprocess.run(
        [runtime, "-c", "import sys; print(sys._base_executable)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    freeze = subprocess.run(
        [runtime, "-m", "pip", "freeze", "--all", "--exclude", "pip", "--exclude", "setuptools"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([base, "-m", "venv", target], check=True, timeout=300)
    python = os.path.join(target, "bin", "python")
    if freeze:
        subprocess.run([python, "-m", "pip", "install", "-q", *freeze], check=True, timeout=900)
    return python


def setup_lines(args, ours_status: dict | None, sf: dict | None, sf_tools: dict | None) -> list[str]:
    lines = []
    if ours_status is not None:
        interp = setups.probe_interpreter(args.python)
        lines.append(
            f"ours: `boltzlabs-gym code-server --port {args.port}` (defaults: 4 lanes x 4 envs, 2048 MiB per"
            f" sandbox), cwd /, from {os.path.dirname(args.python)} (Python {interp.version}); isolation"
            f" {(ours_status.get('isolation') or {}).get('backend')}; code runtime {_TABLE.DEFAULT_RUNTIME}"
        )
        programs = ours_status.get("python")
        if args.programs_python:
            mirror = setups.probe_interpreter(args.programs_python)
            freeze = subprocess.run(
                [args.programs_python, "-m", "pip", "freeze"], capture_output=True, text=True
            ).stdout.split()
            lines.append(
                f"ours' Python programs (python, pytest): {programs}, Python {mirror.version}, pip freeze:"
                f" {' '.join(freeze) or 'nothing'}"
                + (
                    " (made by --mirror-sandboxfusion-runtime: SandboxFusion's runtime venv's base"
                    " interpreter and pip freeze)"
                    if args.mirror_sandboxfusion_runtime
                    else ""
                )
            )
        else:
            lines.append(f"ours' Python programs (python, pytest): {programs} (--python worker: the server's own)")
    if sf is not None:
        lines += [line.strip() for line in sf.get("lines") or []] or [
            "SandboxFusion: its setup is not described (no --sandboxfusion-home)"
        ]
    if sf_tools:
        missing = [t for t, where in sf_tools.items() if where.strip() == "MISSING"]
        lines.append(
            "SandboxFusion's toolchains, found by its runners (python, pytest: the python runner; others: bash): "
            + ", ".join(f"{t} {w.strip()}" for t, w in sf_tools.items())
            + (f" (missing: {', '.join(missing)})" if missing else "")
        )
        if args.sandboxfusion_home:
            node_modules = os.path.join(args.sandboxfusion_home, "src", "runtime", "node", "node_modules")
            there = "present" if os.path.isdir(node_modules) else "ABSENT"
            lines.append(f"SandboxFusion's Node.js packages {node_modules}: {there}")
    if "subprocess" in args.servers.split(","):
        lines.append(
            "subprocess: a thread per client, `subprocess.run` of the language table's compile and run commands"
            f" (the same as ours, code runtime {_TABLE.DEFAULT_RUNTIME}) in a fresh temp dir per run, PATH"
            f" {_TABLE.PATH}, Python programs on {args.programs_python or sys.executable}; no sandbox, no memory"
            " limit, no HTTP"
        )
    lines.append(f"run_timeout {RUN_TIMEOUT:g} s, compile_timeout {COMPILE_TIMEOUT:g} s, memory_limit_MB not sent")
    return lines


# --------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--languages", help=f"comma-separated (default: all {len(PROGRAMS)})")
    p.add_argument("--seconds", type=float, help="timed window per system, round and language (default: per language)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probe-only", action="store_true", help="one run per language and system, nothing timed")
    p.add_argument("--smoke", action="store_true", help=f"{','.join(SMOKE_LANGUAGES)}, one round of 1.5 s")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {','.join(SERVERS)}")
    p.add_argument("--python", default=sys.executable, help="ours runs from this interpreter's environment")
    p.add_argument("--port", type=int, default=18191)
    p.add_argument("--sandboxfusion", metavar="URL", help="SandboxFusion's server, started beforehand")
    p.add_argument("--sandboxfusion-home", metavar="DIR", help="the folder setup.sh made for it: its setup is printed")
    p.add_argument(
        "--programs-python",
        metavar="PATH",
        help="ours runs Python programs (python, pytest) on this interpreter (under /usr or the worker's"
        " own installation; default: the server's own, --python worker)",
    )
    p.add_argument(
        "--mirror-sandboxfusion-runtime",
        action="store_true",
        help=f"make {MIRROR_VENV} with SandboxFusion's runtime venv's interpreter and packages (needs"
        " --sandboxfusion-home, and root) and run ours' Python programs on it",
    )
    p.add_argument("--record", metavar="NAME", help="write NAME.md and NAME.json into --record-dir")
    p.add_argument("--record-dir", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.languages = args.languages or ",".join(SMOKE_LANGUAGES)
        args.seconds = args.seconds or 1.5
        args.rounds = 1
    args.language_list = args.languages.split(",") if args.languages else list(PROGRAMS)
    unknown = [x for x in args.language_list if x not in PROGRAMS]
    if unknown:
        p.error(f"--languages: unknown {unknown}; served: {','.join(PROGRAMS)}")
    if args.mirror_sandboxfusion_runtime and not args.sandboxfusion_home:
        p.error("--mirror-sandboxfusion-runtime needs --sandboxfusion-home")
    bad = set(args.servers.split(",")) - set(SERVERS)
    if bad:
        p.error(f"--servers: unknown {sorted(bad)}; expected a subset of {','.join(SERVERS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    wanted = args.servers.split(",")
    head = cs.header(args)
    head["date_u"] = subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
    log_dir = tempfile.mkdtemp(prefix="lang-bench-logs-")
    systems: list[System] = []
    ours_status = sf = sf_tools = None
    flags: list[str] = []
    keep_logs = False
    try:
        if args.mirror_sandboxfusion_runtime:
            args.programs_python = mirror_sandboxfusion_runtime(args.sandboxfusion_home)
        if "ours" in wanted:
            target = start_ours(args.python, args.port, log_dir, args.programs_python)
            systems.append(System(target, {}))
            target.run = via_server(target.url, systems[-1].detail)
            ours_status = cs.get_json(target.url + "/v1/status")
        if "sandboxfusion" in wanted:
            sf_target, why = cs.sandboxfusion_target(args)
            if sf_target is None:
                cs.log(f"skipped sandboxfusion: {why}")
                flags.append(f"SandboxFusion not measured: {why}")
            else:
                systems.append(System(sf_target, {}))
                sf_target.run = via_server(sf_target.url, systems[-1].detail)
                sf_tools = sandboxfusion_tools(sf_target.url)
                sf = {}
                if args.sandboxfusion_home:
                    desc = setups.describe_sandboxfusion(args.sandboxfusion_home, sf_target.url)
                    sf = {"setup": desc.to_json(), "lines": desc.lines()}
        if "subprocess" in wanted:
            detail: dict = {}
            runtime = _TABLE.DEFAULT_RUNTIME
            python = args.programs_python or sys.executable  # (as ours' Python programs: see SAME_PYTHON)
            target = cs.Target("subprocess", via_subprocess(runtime, detail, python), subtract_client_cpu=False)
            systems.append(System(target, detail))
        lines = setup_lines(args, ours_status, sf, sf_tools)
        for line in lines:
            cs.log(line)
        cells = []
        for language in args.language_list:
            cell = measure_language(systems, language, args)
            for flag in cell["flags"]:
                cs.log(f"!!! {flag}")
            flags += cell["flags"]
            cells.append(cell)
        result = {
            "header": head,
            "servers": [s.target.name for s in systems],
            "setup_lines": lines,
            "sandboxfusion": sf,
            "sandboxfusion_tools": sf_tools,
            "cells": cells,
            "flags": flags,
            "load_end": [round(x, 2) for x in os.getloadavg()],
        }
        print("\n".join(table(cells, result["servers"])), flush=True)
        markdown = report(args, result)
        if args.record:
            cs.write_record(args.record, args.record_dir, markdown, result)
        else:
            print(markdown, flush=True)
        keep_logs = any("hard-reset" in f for f in flags)
    finally:
        cs.stop([s.target for s in systems])
        if keep_logs:
            cs.log(f"our server's log kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
