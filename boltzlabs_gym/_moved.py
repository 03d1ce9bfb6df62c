"""Old module paths, from before the package was laid out by process, kept importable.

``import boltzlabs_gym.pool`` (now :mod:`boltzlabs_gym.client.pool`) and the like still work:
the old name is bound to the very module object of the new one, so classes keep one identity,
``python -m boltzlabs_gym.gym_server`` runs the new module, and pickles or saved files that name
an old path load. Standard library only: env processes import the package too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

#: old module -> where it lives now.
MOVED = {
    "boltzlabs_gym.envstate": "boltzlabs_gym.envside.state",
    "boltzlabs_gym.gym_server": "boltzlabs_gym.envside.gym_start",
    "boltzlabs_gym.factories": "boltzlabs_gym.envside.factories",
    "boltzlabs_gym.worker.forkserver": "boltzlabs_gym.envside.forkserver",
    "boltzlabs_gym.worker.cowfork": "boltzlabs_gym.envside.memory_snapshot",
    "boltzlabs_gym.worker.sandbox._linux": "boltzlabs_gym.envside.syscalls",
    "boltzlabs_gym.worker.sandbox.seccomp": "boltzlabs_gym.envside.seccomp",
    "boltzlabs_gym.protocol": "boltzlabs_gym.wire.protocol",
    "boltzlabs_gym.codec": "boltzlabs_gym.wire.codec",
    "boltzlabs_gym.spaces": "boltzlabs_gym.wire.spaces",
    "boltzlabs_gym.envpipe": "boltzlabs_gym.wire.envpipe",
    "boltzlabs_gym.channel": "boltzlabs_gym.wire.channel",
    "boltzlabs_gym.archive": "boltzlabs_gym.wire.archive",
    "boltzlabs_gym.keys": "boltzlabs_gym.wire.keys",
    "boltzlabs_gym.lending": "boltzlabs_gym.wire.call_rules",
    "boltzlabs_gym.pool": "boltzlabs_gym.client.pool",
    "boltzlabs_gym.link": "boltzlabs_gym.client.link",
    "boltzlabs_gym.routes": "boltzlabs_gym.client.routes",
    "boltzlabs_gym.startup": "boltzlabs_gym.client.startup",
    "boltzlabs_gym.lane": "boltzlabs_gym.client.direct_lane",
    "boltzlabs_gym.grouping": "boltzlabs_gym.client.grouping",
    "boltzlabs_gym.results": "boltzlabs_gym.client.results",
    "boltzlabs_gym.snapshot": "boltzlabs_gym.client.snapshot",
    "boltzlabs_gym.sources": "boltzlabs_gym.client.sources",
    "boltzlabs_gym.stats": "boltzlabs_gym.client.stats",
    "boltzlabs_gym.timing": "boltzlabs_gym.client.timing",
    "boltzlabs_gym.check": "boltzlabs_gym.cli.check",
    "boltzlabs_gym.top": "boltzlabs_gym.cli.top",
    "boltzlabs_gym.worker.lender": "boltzlabs_gym.worker.direct_lane",
    "boltzlabs_gym.worker.copies": "boltzlabs_gym.worker.memory_snapshots.launcher",
    "boltzlabs_gym.worker.holders": "boltzlabs_gym.worker.memory_snapshots.holders",
    "boltzlabs_gym.worker.sandbox.notify": "boltzlabs_gym.worker.memory_snapshots.gate",
    "boltzlabs_gym.worker.snapshots": "boltzlabs_gym.worker.snapshot_store",
    "boltzlabs_gym.worker.memory": "boltzlabs_gym.worker.pss",
    "boltzlabs_gym.worker.scheduling": "boltzlabs_gym.worker.scheduler",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds an old module name and hands back the module that now holds its code."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when create_module imported it

    def get_code(self, fullname: str) -> CodeType | None:
        # python -m OLD_NAME: run the new module as __main__ under its own name, so that its
        # relative imports resolve from where it lives now
        return compile(
            f"import runpy\nrunpy.run_module({MOVED[fullname]!r}, run_name='__main__', alter_sys=True)\n",
            fullname,
            "exec",
        )

    def get_source(self, fullname: str) -> str | None:
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (after the regular finders: a real module wins)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
