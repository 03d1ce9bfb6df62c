"""How each server ``code_server.py`` measures was set up, read from the setups themselves.

A throughput figure against SandboxFusion means little without its setup beside it: which
commit, which HTTP stack (uvicorn with or without uvloop and httptools), which isolation, and
which interpreter its programs start (a runtime whose site-packages run ``.pth`` imports pays
tens of ms per program; ../shared/notes/sandboxfusion.md, "A fair setup"). This module reads
those facts from a SandboxFusion home made by ``setup.sh``, probes interpreters (version,
start-up time), and makes the bare venv the subprocess pool runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

HTTP_STACK = ("uvicorn", "uvloop", "httptools", "fastapi", "pydantic")

# Run by an interpreter under inspection: its version, executable and HTTP stack, as JSON.
_PROBE = """
import glob, json, os, site, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
print(json.dumps({"version": sys.version.split()[0], "executable": sys.executable,
                  "base_executable": getattr(sys, "_base_executable", sys.executable),
                  "packages": {n: version(n) for n in sys.argv[1:]},
                  "pth": sorted(os.path.basename(p) for d in dirs for p in glob.glob(os.path.join(d, "*.pth")))}))
"""


@dataclass
class Interpreter:
    """A Python interpreter as a benchmark reports it."""

    path: str
    version: str
    base_executable: str
    startup_ms: float  # median wall time of ``python -c pass``
    packages: dict[str, str | None] = field(default_factory=dict)
    pth_files: list[str] = field(default_factory=list)  # .pth files its site-packages run at every start

    def line(self) -> str:
        more = len(self.pth_files) - 3
        pth = ", ".join(self.pth_files[:3]) + (f" and {more} more" if more > 0 else "") if self.pth_files else "none"
        return f"{self.path}: Python {self.version}, start-up {self.startup_ms:.1f} ms (median of 10), .pth: {pth}"


def probe_interpreter(path: str, packages: tuple[str, ...] = (), startups: int = 10) -> Interpreter:
    """Ask ``path`` for its version and packages, and time its start-up (``python -c pass``)."""
    out = subprocess.run([path, "-c", _PROBE, *packages], capture_output=True, text=True, timeout=60, check=True)
    facts = json.loads(out.stdout)
    return Interpreter(
        path=path,
        version=facts["version"],
        base_executable=facts["base_executable"],
        startup_ms=startup_ms(path, startups),
        packages=facts["packages"],
        pth_files=facts["pth"],
    )


def startup_ms(python: str, n: int = 10) -> float:
    """Median wall time of ``python -c pass``: what a fresh interpreter per program costs before it runs."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run([python, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def make_bare_venv(base_python: str) -> tuple[str, tempfile.TemporaryDirectory]:
    """A fresh venv with nothing installed (no pip, no system site-packages) from ``base_python``.

    The subprocess pool runs this one, not the venv of our server (whose site-packages may run
    editable-install ``.pth`` hooks at every start) nor SandboxFusion's runtime (absent when
    SandboxFusion is not measured): a bare interpreter of the same build as ours, made here so
    that nothing has been installed into it. The caller removes it (``cleanup()``).
    """
    holder = tempfile.TemporaryDirectory(prefix="code-bench-venv-")
    venv = os.path.join(holder.name, "venv")
    subprocess.run([base_python, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    return os.path.join(venv, "bin", "python"), holder


@dataclass
class SandboxFusionSetup:
    """What a SandboxFusion home made by ``setup.sh`` says of itself."""

    home: str
    commit: str
    server_packages: dict[str, str | None]
    isolation: str | None
    max_concurrency: int | None
    runtime: Interpreter
    running: str  # the server at the URL: its pid, port and SHLVL, or why they are unknown

    def lines(self) -> list[str]:
        stack = ", ".join(f"{k} {v}" for k, v in self.server_packages.items())
        return [
            f"SandboxFusion home {self.home}",
            f"  commit: {self.commit}",
            f"  server venv: {stack}",
            f"  config sandbox/configs/local.yaml: isolation {self.isolation}, max_concurrency {self.max_concurrency}",
            f"  runtime venv: {self.runtime.line()}",
            f"  server: {self.running}",
        ]

    def to_json(self) -> dict:
        return asdict(self)


def describe_sandboxfusion(home: str, url: str | None, source: str | None = None) -> SandboxFusionSetup:
    """Read the setup of the SandboxFusion in ``home`` (made by ``setup.sh``), and check the server at ``url``."""
    server_python = os.path.join(home, "venv", "bin", "python")
    facts = _sandboxfusion_venv_facts(server_python, os.path.join(home, "src", "sandbox", "configs", "local.yaml"))
    return SandboxFusionSetup(
        home=home,
        commit=sandboxfusion_commit(os.path.join(home, "src"), source),
        server_packages=facts["packages"],
        isolation=facts["sandbox"].get("isolation"),
        max_concurrency=facts["sandbox"].get("max_concurrency"),
        runtime=probe_interpreter(os.path.join(home, "runtime-venv", "bin", "python")),
        running=running_server(home, url),
    )


def _sandboxfusion_venv_facts(server_python: str, config: str) -> dict:
    # Its own venv reads its own config: it has the pinned PyYAML, ours may not.
    code = (
        "import json, sys, yaml\nfrom importlib import metadata\n"
        "def version(name):\n    try:\n        return metadata.version(name)\n"
        "    except metadata.PackageNotFoundError:\n        return None\n"
        "with open(sys.argv[1]) as f:\n    sandbox = yaml.safe_load(f).get('sandbox', {})\n"
        "print(json.dumps({'sandbox': sandbox, 'packages': {n: version(n) for n in sys.argv[2:]}}))"
    )
    out = subprocess.run(
        [server_python, "-c", code, config, *HTTP_STACK], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


def sandboxfusion_commit(src: str, source: str | None) -> str:
    """The commit ``src`` was made from: its own ``.git``, else ``source`` (a git dir) if its HEAD matches ``src``."""
    if os.path.exists(os.path.join(src, ".git")):
        out = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.strip()
    if source:
        return _commit_if_same_tree(source, src)
    # setup.sh copies a `git archive` of the source, which stamps every file with the commit's time.
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(os.path.getmtime(os.path.join(src, "pyproject.toml"))))
    return f"unknown (no .git in {src}; its files are dated {stamp}; --sandboxfusion-source GITDIR names it)"


def _commit_if_same_tree(git_dir: str, src: str) -> str:
    head = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return f"unknown ({git_dir} is not a git dir: {head.stderr.strip()})"
    # tar --compare reads the archive of HEAD and compares every file in it with src.
    archive = subprocess.Popen(["git", "--git-dir", git_dir, "archive", "HEAD"], stdout=subprocess.PIPE)
    diff = subprocess.run(["tar", "--compare", "-C", src], stdin=archive.stdout, capture_output=True, text=True)
    archive.wait()
    commit = head.stdout.strip()
    # A copy of a checkout (cp -a) keeps the checkout's file times: only contents and sizes count.
    differences = [line for line in diff.stdout.splitlines() if not line.endswith("Mod time differs")]
    if not differences:
        return f"{commit} (its files match {src})"
    return f"{commit}? ({git_dir}'s HEAD differs from {src}: {differences[:3]})"


def running_server(home: str, url: str | None) -> str:
    """The server ``start.sh`` started (pid file): its pid, whether it listens on ``url``'s port, its SHLVL."""
    try:
        with open(os.path.join(home, "server.pid")) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except (OSError, ValueError) as e:
        return f"not started by {home}/start.sh, or gone ({e})"
    port = argv[argv.index("--port") + 1] if "--port" in argv else "?"
    shlvl = _environ_of(pid).get("SHLVL", "unset")
    wanted = str(urlsplit(url).port) if url else None
    where = "" if wanted in (None, port) else f" (NOT {url}'s port: the server measured is another one)"
    # SHLVL=1: the per-request `bash -c` does not source ~/.bashrc (the notes' third point).
    return f"pid {pid}, port {port}{where}, SHLVL={shlvl}"


def _environ_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in items if "=" in item)
