"""``boltzlabs-gym code-languages`` and ``boltzlabs-gym code-runtime install``: which of SandboxFusion's
languages this host can run (and why not the others), and installing what programs expect.

    boltzlabs-gym code-languages                     a table: language, runs here?, why not
    boltzlabs-gym code-languages --json              the same as JSON (as /v1/status reports it)
    boltzlabs-gym code-languages --debian-packages   the Debian packages every served language needs
    boltzlabs-gym code-runtime install               tsx, jest and babel; the Python runtime venv
    boltzlabs-gym code-runtime install --python-packages core
                                                     the venv with pytest, numpy, pandas, scipy, ... only
"""

from __future__ import annotations

import argparse
import json
import sys

_RUNTIME_DEFAULT = "$BOLTZLABS_CODE_RUNTIME, else /usr/local/lib/boltzlabs-code-runtime"

__all__ = ["add_code_languages_flags", "add_code_runtime_flags", "run_code_languages", "run_code_runtime"]


def add_code_languages_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--json", action="store_true", help="print JSON: language -> null or why it cannot run")
    p.add_argument(
        "--debian-packages", action="store_true", help="print the Debian packages the served languages need, one line"
    )
    p.add_argument("--runtime", default=None, help=f"the code runtime to look in (default {_RUNTIME_DEFAULT})")
    return p


def run_code_languages(args: argparse.Namespace) -> int:
    from ..code import languages

    if args.debian_packages:
        print(" ".join(languages.DEBIAN_PACKAGES))
        return 0
    found = languages.availability(args.runtime)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    width = max(map(len, found))
    for name, why in found.items():
        print(f"{name:<{width}}  {'yes' if why is None else 'no '}  {why or ''}".rstrip())
    print("\nwhere SandboxFusion's toolchain differs:")
    for lang, theirs, ours in languages.STAND_INS:
        print(f"  {lang}: {ours}, for its {theirs}")
    return 0


def add_code_runtime_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("action", choices=["install"], help="install the code runtime")
    p.add_argument("--runtime", default=None, help=f"where, under /usr (default {_RUNTIME_DEFAULT})")
    p.add_argument("--no-node", action="store_true", help="skip the Node.js packages")
    p.add_argument("--no-python", action="store_true", help="skip the Python runtime venv")
    p.add_argument("--no-jvm", action="store_true", help="skip the JVM toolchains' class-data-sharing archives")
    p.add_argument("--no-cpp", action="store_true", help="skip the precompiled C++ standard headers")
    p.add_argument(
        "--python-packages",
        choices=["core", "full"],
        default="full",
        help="the Python venv's packages: full, SandboxFusion's Python runtime (about 6 GB), or core: "
        "pytest, numpy, pandas, scipy, scikit-learn, matplotlib (default full)",
    )
    return p


def run_code_runtime(args: argparse.Namespace) -> int:
    import logging

    from ..code.code_runtime import RuntimeInstallError, install
    from ..code.python_runtime import PACKAGE_SETS

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    packages = PACKAGE_SETS[args.python_packages]
    try:
        done = install(
            args.runtime,
            node=not args.no_node,
            python=not args.no_python,
            python_packages=packages,
            jvm=not args.no_jvm,
            cpp=not args.no_cpp,
        )
    except RuntimeInstallError as exc:
        print(f"code runtime: {exc}", file=sys.stderr)
        return 1
    for what, where in done.items():
        print(f"{what}: {where}")
    return 0
