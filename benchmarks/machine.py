"""What a benchmark record says of the machine it ran on: the CPU model, the memory, the versions
of the packages that matter to it (shared by ``real_envs.py`` and ``training.py``)."""

from __future__ import annotations

import platform
from importlib import metadata


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        model = None
    return model if model is not None else platform.processor()


def mem_total_gib() -> float:
    """The machine's memory (``MemTotal``), GiB to one decimal."""
    with open("/proc/meminfo") as f:
        kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
    return round(kib / 2**20, 1)


def package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """Each package's installed version, ``None`` where it is not installed."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
