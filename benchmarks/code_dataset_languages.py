"""A public multi-language dataset graded by our code server and by SandboxFusion, side by side.

    # SandboxFusion set up in /work/sf and started beforehand: SF_HOME=/work/sf /work/sf/start.sh 8090
    python benchmarks/code_dataset_languages.py --sandboxfusion http://127.0.0.1:8090 \\
        --sandboxfusion-home /work/sf --record code-dataset-languages-DATE
    # a quick look: 2 languages, 3 programs each
    python benchmarks/code_dataset_languages.py --smoke --sandboxfusion http://127.0.0.1:8090

The dataset: the MultiPL-E HumanEval samples SandboxFusion's own tests grade
(``sandbox/tests/datasets/samples/Multi-PLE/humaneval-<lang>.jsonl``: each row a MultiPL-E problem,
its ``tests`` and a model's answer in ``gpt_solution``), read at run time from a SandboxFusion
checkout or git mirror (``--mirror``; default the stored mirror) or from a folder of those files
(``--samples-dir``). Nothing of SandboxFusion's is copied into this repository.

Each row becomes one program the way SandboxFusion's ``MultiPLEDataset.evaluate_single`` builds it
for a free-form answer (``sandbox/datasets/multiple.py``, ``sandbox/utils/extraction.py``; written
anew here, see :func:`build_program`): the answer's code block is extracted, cut at the row's stop
tokens (some languages), any ``main`` removed (D, C#), the row's ``tests`` appended, the language's
import lines put in front (read from the same checkout's ``sandbox/utils/helpers.py``), Java's
``class Problem`` renamed ``Main``, Go's packages and imports gathered at the top. The identical
``POST /run_code`` (``language``, ``code``, ``compile_timeout`` and ``run_timeout`` 20 s, as
``evaluate_single`` sends) goes to ``boltzlabs-gym code-server`` (started here by ``--python``) and to
SandboxFusion at ``--sandboxfusion``; a program passes where the answer's ``status`` is ``Success``.

Per language: programs, passed by each, how many verdicts agree, each system's wall time for the
language's programs at ``--concurrency``. Every disagreement is listed with both statuses and the
first lines of each side's stderr, and is then sent again to both, one program at a time
(``--no-recheck`` skips it), so that a verdict lost to load (a compile timeout at concurrency 8 on
two cores) shows as such. ``--record NAME`` writes ``benchmarks/results/NAME.md`` and ``.json``.

MultiPL-E's ``jl`` and ``swift`` are not sent: neither system has Julia or Swift here. ``cs`` and
``d`` are sent to both, but SandboxFusion calls ``dotnet`` and ``dmd``, which are not on this
machine (our server runs them with Mono and LDC); their disagreements are summarised, not listed.
"""

from __future__ import annotations

import argparse
import ast
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import code_server as bench  # noqa: E402
import code_server_setups as setups  # noqa: E402

DEFAULT_MIRROR = "/work/.mirror/bytedance+SandboxFusion/repo"
SAMPLES_PATH = "sandbox/tests/datasets/samples/Multi-PLE"
HELPERS_PATH = "sandbox/utils/helpers.py"
TIMEOUT_S = 20.0  # evaluate_single's compile_timeout and run_timeout when the config names none


@dataclass(frozen=True)
class Suite:
    """One MultiPL-E language: the ``language`` both servers are asked for, and how a row becomes a program.

    ``extract``: the name SandboxFusion's dataset code gives the language while it extracts code
    and picks import lines (``extract_lang_map``); ``whole_answer``: the answer's code block is the
    program (``_gen_sft_func_code``), else it is cut at the row's stop tokens
    (``_gen_sft_stop_token_code``). ``sf_needs``: the command SandboxFusion's runner calls.
    """

    run: str
    extract: str
    whole_answer: bool
    sf_needs: str


SUITES = {
    "cpp": Suite("cpp", "cpp", False, "g++"),
    "cs": Suite("csharp", "csharp", False, "dotnet"),
    "d": Suite("D_ut", "d", True, "dmd"),
    "go": Suite("go_test", "go", True, "go"),
    "java": Suite("java", "java", False, "javac"),
    "js": Suite("nodejs", "js", True, "node"),
    "lua": Suite("lua", "lua", True, "lua"),
    "php": Suite("php", "php", True, "php"),
    "pl": Suite("perl", "perl", True, "perl"),
    "r": Suite("R", "r", True, "Rscript"),
    "rb": Suite("ruby", "ruby", True, "ruby"),
    "rkt": Suite("racket", "racket", True, "racket"),
    "rs": Suite("rust", "rust", False, "rustc"),
    "scala": Suite("scala", "scala", False, "scala"),
    "sh": Suite("bash", "bash", False, "bash"),
    "ts": Suite("typescript", "typescript", True, "tsx"),
}
NOT_SENT = {
    "jl": "julia: neither system has Julia here (none in Debian 12; SandboxFusion calls `julia`)",
    "swift": "swift: neither system has Swift here (none in Debian 12; SandboxFusion calls `swift`)",
}
SMOKE = ("cpp", "lua")

# Fence tags SandboxFusion's extraction knows, and the language each names (what its
# ``aliases_to_language_tiled`` gives; a tag it does not know names no language).
FENCE_TAGS = {
    "python": ("python", "Python", "py", "Python3", "python3", "PY"),
    "cpp": ("cpp", "c++", "C++", "Cpp", "CPP"),
    "nodejs": ("JS", "js"),
    "go": ("go", "Go"),
    "java": ("java", "Java"),
    "php": ("php", "PHP"),
    "csharp": ("csharp", "c#", "C#"),
    "bash": ("bash", "Bash", "BASH", "sh", "shell"),
    "typescript": ("typescript",),
    "rust": ("rust", "Rust", "rs"),
    "sql": ("sql", "SQL", "Sql"),
    "D": ("D", "d"),
    "julia": ("julia", "Julia", "jl"),
    "lua": ("lua", "Lua"),
    "perl": ("perl", "Perl", "PERL"),
    "R": ("R", "r"),
    "ruby": ("ruby", "Ruby"),
    "scala": ("scala", "Scala"),
    "kotlin": ("kotlin", "Kotlin"),
    "c": ("c", "C"),
    "html": ("html", "Html", "HTML"),
    "javascript": ("javascript", "Javascript", "JavaScript"),
    "verilog": ("verilog", "Verilog", "VERILOG"),
    "racket": ("racket",),
    "swift": ("swift",),
}
TAG_LANGUAGE = {tag: lang for lang, tags in FENCE_TAGS.items() for tag in tags}
FENCED = re.compile(r"```([^\n]*)\n(.*?)\n\s*```", re.DOTALL | re.MULTILINE)
OPEN_FENCE = re.compile(r"```([^\n]*)\n(.*)", re.DOTALL | re.MULTILINE)
MAIN_STARTS = {"d": "void main", "csharp": "public static void Main"}


# --------------------------------------------------------------------------- the dataset
def read_samples(suite: str, args) -> list[dict]:
    """The rows of ``humaneval-<suite>.jsonl``: from ``--samples-dir``, else from ``--mirror``'s HEAD."""
    name = f"{args.dataset}-{suite}.jsonl"
    if args.samples_dir:
        with open(os.path.join(args.samples_dir, name)) as f:
            text = f.read()
    else:
        text = git_show(args.mirror, f"{SAMPLES_PATH}/{name}")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def git_show(repo: str, path: str) -> str:
    out = subprocess.run(["git", "-C", repo, "show", f"HEAD:{path}"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"cannot read {path} from {repo}: {out.stderr.strip()}")
    return out.stdout


def read_import_lines(repo: str) -> dict[str, list[str]]:
    """``IMPORT_HELPER`` of the checkout's ``sandbox/utils/helpers.py``: read as a literal, not run."""
    tree = ast.parse(git_show(repo, HELPERS_PATH))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "IMPORT_HELPER" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"no IMPORT_HELPER in {repo}:{HELPERS_PATH}")


def mirror_commit(repo: str) -> str:
    out = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()})"


# --------------------------------------------------------------------------- a row -> a program
@dataclass
class Block:
    priority: int  # 30 a closed fence, 20 an open one, 10 a heuristic guess
    language: str
    code: str


def fenced(text: str) -> list[Block]:
    return [Block(30, TAG_LANGUAGE.get(tag.strip(), ""), code) for tag, code in FENCED.findall(text)]


def open_fenced(text: str) -> list[Block]:
    return [Block(20, TAG_LANGUAGE.get(tag.strip(), ""), code) for tag, code in OPEN_FENCE.findall(text)]


def guessed(text: str, language: str) -> list[Block]:
    """Code outside any fence: only shell answers are taken whole (non-blank lines)."""
    if language != "bash":
        return []
    return [Block(10, "bash", "\n".join(line for line in text.split("\n") if line.strip()) + "\n")]


def answer_code(answer: str, language: str) -> str:
    """The answer's code block (``_gen_sft_func_code``): the best kind of block found, that language's first.

    SandboxFusion compares a block's language with the dataset's own name for it, which for
    ``js``, ``r`` and ``d`` is never a fence's language: those take the first block of the best kind.
    """
    blocks = fenced(answer) + guessed(answer, language) + open_fenced(answer)
    if not blocks:
        return ""
    best = max(b.priority for b in blocks)
    blocks = [b for b in blocks if b.priority == best]
    return next((b.code for b in blocks if b.language == language), blocks[0].code)


def first_block(answer: str, language: str) -> str:
    """The first block (``_gen_sft_stop_token_code``): closed fences, else an open one, else a guess; tidied."""
    blocks = fenced(answer) or open_fenced(answer) or guessed(answer, language)
    code = blocks[0].code.replace("\r", "") if blocks else ""
    if language == "cpp" and "int main()" in code:
        code = code[: code.index("int main()")].strip()
    elif language == "java" and "public class Main {\n" in code:
        code = code.replace("public class Main {\n", "class Solution {\n")
        code = code.replace("public static void main(String[] args)", "")
    elif language == "go":
        code = code.replace("package main", "")
    if "# Example usage" in code:
        code = code[: code.index("# Example usage")].strip()
    return code


def cut_at_stop_tokens(code: str, stop_tokens: list[str] | None) -> str:
    """Cut at each of the row's stop tokens in turn (``re:`` ones are patterns); a blank line is not one."""
    for token in stop_tokens or ():
        if token == "\n\n":
            continue
        if token.startswith("re:"):
            match = re.search(token[3:].strip(), code)
            at = match.start() if match else -1
        else:
            at = code.find(token)
        if at != -1:
            code = code[:at]
    return code


def drop_main(code: str, language: str) -> str:
    start = MAIN_STARTS.get(language)
    if start is not None and start in code:
        code = code[: code.index(start)]
    return code


def gather_go_header(code: str) -> str:
    """One ``package`` line per package named and every import, single or grouped, at the top."""
    packages = set(re.findall(r"package\s+(\w+)", code))
    code = re.sub(r"package\s+(\w+)", "", code)
    single = re.findall(r'import\s+("\w+")', code)
    grouped = [
        line.strip() for group in re.findall(r"import\s+\((.*?)\)", code, flags=re.DOTALL) for line in group.split("\n")
    ]
    imports = set(single + grouped) - {""}
    code = re.sub(r'import\s+("\w+")', "", code)
    code = re.sub(r"import\s+\((.*?)\)", "", code, flags=re.DOTALL)
    head = "\n".join(f"package {p}" for p in packages) + "\n\n" + "\n".join(f"import {i}" for i in imports)
    return head + "\n\n" + code


def build_program(row: dict, suite: Suite, import_lines: dict[str, list[str]]) -> str:
    """The program SandboxFusion's ``MultiPLEDataset`` grades for the free-form answer ``row["gpt_solution"]``."""
    answer = row["gpt_solution"]
    if suite.whole_answer:
        code = answer_code(answer, suite.extract)
    else:
        code = cut_at_stop_tokens(first_block(answer, suite.extract), row.get("stop_tokens"))
    code = drop_main(code, suite.extract)
    program = "\n".join(import_lines.get(suite.extract, [])) + "\n" + f"{code}\n{row['tests']}"
    if suite.run == "java":
        program = program.replace("class Problem", "class Main")
    if suite.extract == "go":
        program = gather_go_header(program)
    return program


# --------------------------------------------------------------------------- sending
@dataclass
class Answer:
    status: str  # Success, Failed, SandboxError, or what went wrong on the way
    wall_s: float
    reply: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "Success"

    def what(self) -> str:
        """The status and each step's status and exit code: ``Failed (compile Finished 1)``."""
        steps = []
        for step in ("compile_result", "run_result"):
            r = self.reply.get(step)
            if r:
                steps.append(f"{step.split('_')[0]} {r.get('status')} {r.get('return_code')}")
        message = self.reply.get("message")
        more = "; ".join(steps + ([f"message: {message[:120]}"] if message else []))
        return f"{self.status} ({more})" if more else self.status

    def stderr_head(self, lines: int = 3) -> str:
        """The first lines of the failing step's stderr (the compile's where it failed, else the run's)."""
        step = self.reply.get("compile_result") or {}
        if step.get("status") in (None, "Finished") and step.get("return_code") in (None, 0):
            step = self.reply.get("run_result") or step
        text = (step.get("stderr") or step.get("stdout") or "").strip() or (self.reply.get("message") or "").strip()
        return "\n".join(text.splitlines()[:lines])


def post(url: str, request: dict) -> Answer:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=3 * TIMEOUT_S + 60)
    t = time.perf_counter()
    try:
        conn.request("POST", "/run_code", json.dumps(request), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException) as e:
        return Answer(f"HTTP error {type(e).__name__}: {e}", time.perf_counter() - t)
    finally:
        conn.close()
    wall = time.perf_counter() - t
    try:
        reply = json.loads(data)
    except ValueError:
        return Answer(f"HTTP {resp.status}, not JSON: {data[:200]!r}", wall)
    if resp.status != 200:
        return Answer(f"HTTP {resp.status}", wall, reply if isinstance(reply, dict) else {})
    return Answer(str(reply.get("status")), wall, reply)


def run_batch(url: str, requests: list[dict], concurrency: int) -> tuple[list[Answer], float]:
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda r: post(url, r), requests))
    return answers, time.perf_counter() - t


# --------------------------------------------------------------------------- the run
def sandboxfusion_path(home: str | None) -> str:
    """The PATH of the SandboxFusion server that ``home/start.sh`` started (its runners call toolchains from it)."""
    if home:
        try:
            with open(os.path.join(home, "server.pid")) as f:
                pid = int(f.read().strip())
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(i.split("=", 1) for i in f.read().decode(errors="replace").split("\0") if "=" in i)
            return env.get("PATH", "")
        except (OSError, ValueError):
            pass
    return os.environ.get("PATH", "")


def sandboxfusion_cannot_run(suite: Suite, sf_path: str, sf_home: str | None) -> str | None:
    """Why SandboxFusion's runner cannot run ``suite`` on this machine, or None.

    Its runner calls ``suite.sf_needs`` from its PATH. Go tests also get its ``runtime/go/go.mod``
    copied beside them, whose ``toolchain`` line a Go before 1.21 cannot parse.
    """
    tool = shutil.which(suite.sf_needs, path=sf_path)
    if tool is None:
        return f"no `{suite.sf_needs}` on SandboxFusion's PATH"
    go_mod = os.path.join(sf_home or "", "src", "runtime", "go", "go.mod")
    if suite.sf_needs == "go" and sf_home and os.path.exists(go_mod):
        with open(go_mod) as f:
            toolchain = [line.strip() for line in f if line.startswith("toolchain ")]
        out = subprocess.run([tool, "env", "GOVERSION"], capture_output=True, text=True)
        version = out.stdout.strip()  # go1.19.8
        numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
        if toolchain and numbers < (1, 21):
            return (
                f"SandboxFusion copies its runtime/go/go.mod (`{toolchain[0]}`) beside every Go test; "
                f"{tool} is {version}, which cannot parse a `toolchain` line"
            )
    return None


def compare_suite(name: str, args, ours_url: str, sf_url: str, import_lines: dict, sf_path: str) -> dict:
    suite = SUITES[name]
    rows = read_samples(name, args)[: args.limits.get(name, args.limit)]
    requests = [
        {
            "language": suite.run,
            "code": build_program(r, suite, import_lines),
            "compile_timeout": TIMEOUT_S,
            "run_timeout": TIMEOUT_S,
        }
        for r in rows
    ]
    cannot = sandboxfusion_cannot_run(suite, sf_path, args.sandboxfusion_home)
    bench.log(f"{name} ({suite.run}): {len(requests)} programs; ours ...")
    ours, ours_wall = run_batch(ours_url, requests, args.concurrency)
    bench.log(f"  ours {sum(a.passed for a in ours)}/{len(ours)} passed in {ours_wall:.1f} s; SandboxFusion ...")
    theirs, sf_wall = run_batch(sf_url, requests, args.concurrency)
    if all(a.status.startswith("HTTP error") for a in theirs):
        raise SystemExit(f"SandboxFusion at {sf_url} stopped answering: {theirs[0].status}")
    bench.log(f"  SandboxFusion {sum(a.passed for a in theirs)}/{len(theirs)} passed in {sf_wall:.1f} s")
    differ = [i for i in range(len(rows)) if ours[i].passed != theirs[i].passed]
    disagreements = []
    for i in differ:
        d = {
            "task": rows[i].get("name") or rows[i].get("task_id"),
            "ours": ours[i].what(),
            "ours_stderr": ours[i].stderr_head(),
            "sf": theirs[i].what(),
            "sf_stderr": theirs[i].stderr_head(),
        }
        if args.recheck and not cannot:
            again_ours, again_sf = post(ours_url, requests[i]), post(sf_url, requests[i])
            d["alone"] = {
                "ours": again_ours.what(),
                "sf": again_sf.what(),
                "differ": again_ours.passed != again_sf.passed,
            }
        disagreements.append(d)
    if differ and args.recheck and not cannot:
        still = sum(d["alone"]["differ"] for d in disagreements)
        bench.log(f"  {len(differ)} disagreements; {still} still disagree when sent alone")
    return {
        "suite": name,
        "language": suite.run,
        "programs": len(rows),
        "passed_ours": sum(a.passed for a in ours),
        "passed_sf": sum(a.passed for a in theirs),
        "same": len(rows) - len(differ),
        "wall_ours_s": round(ours_wall, 1),
        "wall_sf_s": round(sf_wall, 1),
        "sf_cannot_run": cannot,
        "sf_statuses": sorted({f"{a.what()}: {stderr_note(a.stderr_head(2))[3:-1]}" for a in theirs})
        if cannot
        else None,
        "ours_failed": [
            {"task": r.get("name"), "ours": o.what(), "ours_stderr": o.stderr_head()}
            for r, o in zip(rows, ours)
            if cannot and not o.passed
        ],
        "disagreements": disagreements,
        "per_program": [
            {
                "task": r.get("name"),
                "ours": o.status,
                "sf": s.status,
                "ours_s": round(o.wall_s, 2),
                "sf_s": round(s.wall_s, 2),
            }
            for r, o, s in zip(rows, ours, theirs)
        ],
    }


def report(args, result: dict) -> str:
    h = result["header"]
    lines = [f"# MultiPL-E ({args.dataset}) graded by our code server and by SandboxFusion", ""]
    lines += bench.header_lines(h)
    lines += ["", "## Setup", ""]
    lines += [
        f"- dataset: `{SAMPLES_PATH}/{args.dataset}-<lang>.jsonl` ({result['samples']}); each row's `gpt_solution`"
    ]
    lines += [
        f"- every program sent to both as the same `POST /run_code`, compile_timeout and run_timeout {TIMEOUT_S:g} s, "
        f"{args.concurrency} at a time, one language and one system at a time (ours first)"
    ]
    lines += [f"- ours: {result['ours']}"]
    lines += [f"- {line}" if not line.startswith("  ") else f"  - {line.strip()}" for line in result["sandboxfusion"]]
    lines += [f"- not sent: {reason}" for reason in NOT_SENT.values()]
    lines += ["", "## Verdicts", ""]
    lines += [
        "| MultiPL-E | language | programs | passed ours | passed SF | same verdict | same once resent alone "
        "| wall ours s | wall SF s |"
    ]
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["suites"]:
        mark = "" if not s["sf_statuses"] else " (SF cannot run it here)"
        lines.append(
            f"| {s['suite']} | {s['language']}{mark} | {s['programs']} | {s['passed_ours']} | {s['passed_sf']} | "
            f"{s['same']} | {same_alone(s)} | {s['wall_ours_s']} | {s['wall_sf_s']} |"
        )
    both = [s for s in result["suites"] if not s["sf_statuses"]]
    n, same = sum(s["programs"] for s in both), sum(s["same"] for s in both)
    alone = sum(same_alone(s) for s in both)
    lines += [
        "",
        f"Where SandboxFusion can run the language here: {same} of {n} verdicts the same at concurrency "
        f"{args.concurrency}; {alone} of {n} once each disagreement was sent again to both, alone.",
        "",
        "## Disagreements",
        "",
    ]
    if not any(s["disagreements"] for s in result["suites"]):
        lines += ["None.", ""]
    for s in result["suites"]:
        if not s["disagreements"]:
            continue
        if s["sf_statuses"]:
            lines += [
                f"### {s['suite']} ({s['language']}): {len(s['disagreements'])}, SandboxFusion cannot run it here",
                "",
                f"{s['sf_cannot_run']}. Its answers: " + "; ".join(f"`{x}`" for x in s["sf_statuses"][:3]),
                "",
                f"The {len(s['ours_failed'])} programs ours fails (SandboxFusion fails them too):"
                if s["ours_failed"]
                else "Ours passes every one of them.",
                "",
            ]
            lines += [
                f"- **{f['task']}**: ours `{f['ours']}`" + stderr_note(f["ours_stderr"]) for f in s["ours_failed"]
            ]
            lines.append("")
            continue
        lines += [f"### {s['suite']} ({s['language']}): {len(s['disagreements'])}", ""]
        for d in s["disagreements"]:
            lines.append(f"- **{d['task']}**: ours `{d['ours']}`, SF `{d['sf']}`")
            if "alone" in d:
                lines.append(f"  - sent again alone: ours `{d['alone']['ours']}`, SF `{d['alone']['sf']}`")
            for who, key in (("ours", "ours_stderr"), ("SF", "sf_stderr")):
                if d[key]:
                    lines.append(f"  - {who} stderr" + stderr_note(d[key]))
        lines.append("")
    return "\n".join(lines) + "\n"


def same_alone(suite: dict) -> int | str:
    """Verdicts the same once every disagreement was sent again to both, one at a time."""
    if suite["sf_statuses"] or any("alone" not in d for d in suite["disagreements"]):
        return "-"
    return suite["same"] + sum(not d["alone"]["differ"] for d in suite["disagreements"])


def stderr_note(text: str) -> str:
    """``: `first lines / of stderr``` on one line, or nothing."""
    flat = " / ".join(x.strip() for x in text.splitlines()).replace("`", "'")[:300]
    return f": `{flat}`" if flat else ""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mirror", default=DEFAULT_MIRROR, help="a SandboxFusion checkout or git dir (its HEAD is read)")
    p.add_argument("--samples-dir", help="a folder of <dataset>-<lang>.jsonl files instead of the mirror's")
    p.add_argument("--dataset", default="humaneval", choices=("humaneval", "mbpp"))
    slowest_last = sorted(SUITES, key=lambda name: name == "scala")  # scalac: seconds of CPU per program
    p.add_argument(
        "--languages",
        default=",".join(slowest_last),
        help=f"MultiPL-E names, of {','.join(SUITES)}; NAME:N sends that language's first N rows only",
    )
    p.add_argument("--limit", type=int, help="only the first N rows of each language")
    p.add_argument("--smoke", action="store_true", help=f"{' and '.join(SMOKE)}, 3 programs each")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--no-recheck", dest="recheck", action="store_false", help="do not resend disagreements alone")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs our server (default: this one)")
    p.add_argument("--port", type=int, default=18281)
    p.add_argument("--lanes", type=int, default=2)
    p.add_argument("--envs-per-lane", type=int, default=4)
    p.add_argument("--sandboxfusion", metavar="URL", default="http://127.0.0.1:8090", help="started beforehand")
    p.add_argument("--sandboxfusion-home", metavar="DIR", help="the folder setup.sh made for it: its setup is printed")
    p.add_argument("--record", metavar="NAME", help="write NAME.md and NAME.json into --record-dir")
    p.add_argument("--record-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--render", metavar="JSON", help="only write a recorded run's markdown again (beside its JSON)")
    args = p.parse_args(argv)
    if args.smoke:
        args.languages, args.limit = ",".join(SMOKE), 3
    wanted, args.limits = [], {}
    for item in args.languages.split(","):
        name, _, n = item.partition(":")
        wanted.append(name)
        if n:
            args.limits[name] = int(n)
    unknown = [w for w in wanted if w not in SUITES]
    if unknown:
        p.error(f"--languages: {unknown} not sent ({'; '.join(NOT_SENT.get(u, 'unknown') for u in unknown)})")
    args.languages = wanted
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # a kill (timeout's SIGTERM) unwinds like an exception, so that our server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as f:
            f.write(report(args, result))
        return 0
    source = args.samples_dir or f"{args.mirror} at {mirror_commit(args.mirror)}"
    import_lines = read_import_lines(args.mirror)
    sf, why = bench.sandboxfusion_target(argparse.Namespace(sandboxfusion=args.sandboxfusion))
    if sf is None:
        raise SystemExit(f"SandboxFusion: {why}")
    sf_lines = (
        setups.describe_sandboxfusion(args.sandboxfusion_home, sf.url, args.mirror).lines()
        if args.sandboxfusion_home
        else [f"SandboxFusion at {sf.url} (no --sandboxfusion-home: its setup is not read)"]
    )
    sf_path = sandboxfusion_path(args.sandboxfusion_home)
    ours_python = setups.probe_interpreter(args.python)
    result: dict = {"header": bench.header(args), "samples": source, "sandboxfusion": sf_lines, "suites": []}
    with tempfile.TemporaryDirectory(prefix="code-dataset-") as log_dir:
        target = bench.start_our_server(args, "boltzlabs", args.port, True, log_dir)
        try:
            result["ours"] = (
                f"`boltzlabs-gym code-server --lanes {args.lanes} --envs-per-lane {args.envs_per_lane} "
                f"--memory-mb 1024` (wipe path) run by {ours_python.line()}"
            )
            for name in args.languages:
                result["suites"].append(compare_suite(name, args, target.url, sf.url, import_lines, sf_path))
                if args.record:  # after every language: a long run cut short keeps what it measured
                    bench.write_record(args.record, args.record_dir, report(args, result), result)
        finally:
            bench.stop([target])
    for s in result["suites"]:
        print(
            f"{s['suite']:6} {s['language']:11} programs {s['programs']:4}  passed ours {s['passed_ours']:4}  "
            f"passed SF {s['passed_sf']:4}  same {s['same']:4}  "
            f"wall ours {s['wall_ours_s']:6.1f} s  SF {s['wall_sf_s']:6.1f} s"
        )
    markdown = report(args, result)
    if args.record:
        bench.write_record(args.record, args.record_dir, markdown, result)
    else:
        print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
