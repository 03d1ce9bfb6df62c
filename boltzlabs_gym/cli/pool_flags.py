"""Command-line flags for pool settings, made from :class:`~boltzlabs_gym.client.options.PoolOptions`'s
fields: ``step_timeout`` is ``--step-timeout``, typed as the field, its help the field's docstring's
first sentence; a flag left out leaves the field's default. A command names the settings it takes
(``boltzlabs-gym code-server``); the worker's own flags for the settings a local pool hands it are
named in :data:`~boltzlabs_gym.wire.protocol.WORKER_FLAGS`.

>>> parser = argparse.ArgumentParser()
>>> add_pool_flags(parser, ["reset_timeout", "direct"])
>>> pool_settings_from(parser.parse_args(["--reset-timeout", "5", "--no-direct"]), ["reset_timeout", "direct"])
{'reset_timeout': 5.0, 'direct': False}
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Sequence

if typing.TYPE_CHECKING:
    from ..client.options import PoolSettings

__all__ = ["add_pool_flags", "flag_of", "pool_settings_from"]

_ROLE = re.compile(r":\w+:`~?([^`]+)`")


def flag_of(name: str) -> str:
    """The flag of the pool setting ``name``: ``--`` and its words joined by ``-``."""
    return "--" + name.replace("_", "-")


def add_pool_flags(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Add a flag for each pool setting of ``names`` to ``parser``, in a group of their own."""
    from ..client.options import PoolOptions, field_docs

    hints, docs = typing.get_type_hints(PoolOptions), field_docs()
    fields = {f.name: f for f in dataclasses.fields(PoolOptions)}
    group = parser.add_argument_group("pool settings", "as PoolOptions' fields (boltzlabs_gym.client.options)")
    for name in names:
        kinds = typing.get_args(hints[name]) or (hints[name],)
        first = _ROLE.sub(r"\1", docs.get(name, "")).replace("``", "").split(". ")[0].rstrip(".")
        help_text = f"{first} (default: {fields[name].default})".replace("%", "%%")
        if bool in kinds:
            group.add_argument(flag_of(name), action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        kind = next((k for k in (float, int, str) if k in kinds), None)
        if kind is None:
            raise ValueError(f"pool setting {name} ({hints[name]}) has no command-line form")
        group.add_argument(flag_of(name), type=kind, default=None, help=help_text)


def pool_settings_from(args: argparse.Namespace, names: Sequence[str]) -> PoolSettings:
    """The settings of ``names`` that ``args`` gives (a flag left out: no setting, its default)."""
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return typing.cast("PoolSettings", given)
