"""The ``process`` backend: no namespaces, only what a plain process can have.

A new session and process group, rlimits, a scrubbed environment and a private
working directory. This is *not* a sandbox: the host filesystem stays readable, the
network reachable and a daemon that calls ``setsid`` escapes the group kill. The
report says so, and ``isolation="strict"`` refuses it.
"""

from __future__ import annotations

import os
import time

from .base import (
    IsolationReport,
    Launched,
    LaunchSpec,
    child_environment,
    child_exec,
    fork_child,
    kill_process_group,
)


def runtime_pythonpath(runtime: dict[str, str]) -> str:
    """``PYTHONPATH`` for the process backend: the parent dirs of the runtime packages, in order."""
    seen: list[str] = []
    for pkg_dir in runtime.values():
        parent = os.path.dirname(os.path.abspath(pkg_dir))
        if parent not in seen:
            seen.append(parent)
    return os.pathsep.join(seen)


class ProcessBackend:
    name = "process"

    def available(self) -> tuple[bool, str]:
        return True, "always available"

    def report(self) -> IsolationReport:
        return IsolationReport(
            backend=self.name,
            properties={
                "readonly_env_dir": False,
                "private_workspace": True,
                "no_network": False,
                "pid_namespace": False,
                "ipc_namespace": False,
                "uts_namespace": False,
                "hidden_host_files": False,
                "scrubbed_environment": True,
                "memory_limit": "RLIMIT_AS",
                "process_limit": "RLIMIT_NPROC" if os.geteuid() != 0 else False,
                "file_size_limit": "RLIMIT_FSIZE",
                "open_files_limit": "RLIMIT_NOFILE",
                "cpu_limit": "RLIMIT_CPU (total backstop)",
                "seccomp": False,
                "dedicated_uid": False,
                "tree_kill": "process group",
            },
            notes=("not a sandbox: env code can read host files, reach the network and signal same-uid processes",),
        )

    def launch(self, spec: LaunchSpec) -> Launched:
        start = time.perf_counter()
        env = child_environment(
            spec,
            env_dir=spec.env_dir,
            workspace=spec.workspace,
            pythonpath=runtime_pythonpath(spec.runtime),
        )

        def body() -> None:
            os.setsid()
            child_exec(spec, spec.workspace, env)  # rlimits set there, after the fds are closed

        pid = fork_child(body)
        return Launched(
            pid=pid,
            kill_tree=lambda: kill_process_group(pid),
            setup_ms=(time.perf_counter() - start) * 1e3,
            paths={"env_dir": spec.env_dir, "workspace": spec.workspace},
        )
