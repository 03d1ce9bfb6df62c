"""Which languages the code runner serves, and which of them this host can run.

The table itself lives with the env that runs the programs (``runner_env/_languages.py``, standard
library only, since it runs inside the sandbox); this module loads it on the host side, for the
server's checks, ``/v1/status`` and ``boltzlabs-gym code-languages``.

>>> from boltzlabs_gym.code.languages import SERVED, canonical
>>> "cpp" in SERVED and canonical("ts")
'typescript'
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

__all__ = [
    "ALIASES",
    "DEBIAN_PACKAGES",
    "DEFAULT_RUNTIME",
    "KNOWN",
    "NOT_SERVED",
    "SERVED",
    "STAND_INS",
    "availability",
    "canonical",
    "program_python",
    "runtime_dir",
]


def _load_table() -> ModuleType:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner_env", "_languages.py")
    spec = importlib.util.spec_from_file_location("boltzlabs_gym.code._language_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses resolve their module by name)
    spec.loader.exec_module(module)
    return module


_TABLE = _load_table()
#: Where ``boltzlabs-gym code-runtime install`` puts the code runtime unless told otherwise.
DEFAULT_RUNTIME: str = _TABLE.DEFAULT_RUNTIME
#: The languages the runner serves, in SandboxFusion's names.
SERVED: tuple[str, ...] = tuple(_TABLE.LANGUAGES)
#: SandboxFusion's other names for served languages (``js``, ``ts``).
ALIASES: dict[str, str] = dict(_TABLE.ALIASES)
#: SandboxFusion's languages not served here -> why.
NOT_SERVED: dict[str, str] = dict(_TABLE.NOT_SERVED)
#: Every name a request may give.
KNOWN: tuple[str, ...] = SERVED + tuple(ALIASES) + tuple(NOT_SERVED)
#: The Debian packages every served language needs.
DEBIAN_PACKAGES: tuple[str, ...] = tuple(_TABLE.DEBIAN_PACKAGES)
#: ``(language, SandboxFusion's toolchain, ours)`` where they differ.
STAND_INS: tuple[tuple[str, str, str], ...] = tuple(_TABLE.STAND_INS)


def canonical(language: str) -> str:
    """The served name for ``language`` (``ts`` -> ``typescript``); other names unchanged."""
    return ALIASES.get(language, language)


def runtime_dir() -> str:
    """The code runtime programs see: ``$BOLTZLABS_CODE_RUNTIME`` or :data:`DEFAULT_RUNTIME`."""
    return os.environ.get("BOLTZLABS_CODE_RUNTIME") or DEFAULT_RUNTIME


def availability(runtime: str | None = None) -> dict[str, str | None]:
    """Each language SandboxFusion names -> ``None`` where it runs on this host, else why not.

    This looks at the host's own ``PATH`` directories and files; a sandbox shows the same
    toolchains (``/usr`` and the top-level ``bin``/``lib`` read-only), so the runner's envs see the
    same, and each env reports what it finds itself at start-up (``CodeRunner.languages``).
    """
    runtime = runtime or runtime_dir()
    return _TABLE.availability(runtime, python=program_python(runtime))


def program_python(runtime: str | None = None) -> str | None:
    """The code runtime's interpreter (``<runtime>/python/bin/python``), where it is installed: the
    one Python programs run under; None where it is not (they run under the worker's own)."""
    python = _TABLE.runtime_python(runtime or runtime_dir())
    return python if os.path.exists(python) else None
