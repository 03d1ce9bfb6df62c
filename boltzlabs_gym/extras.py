"""Optional dependencies, imported when a feature needs them, failing with the install command.

>>> require("json", "metrics").__name__
'json'
>>> require("no_such_module", "metrics", "top")  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
boltzlabs_gym.errors.MissingExtraError: top needs no_such_module, which is not installed: pip install '...[metrics]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError

__all__ = ["require"]


def require(module: str, extra: str, feature: str = "this") -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the package ``extra`` that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{feature} needs {module}, which is not installed: pip install 'boltzlabs-gym[{extra}]'", extra
        ) from None
