"""The trainer's side of a factory env directory: env factories written where the sandbox finds them.

:func:`write_factory_env_dir` turns zero-arg env factories (``make_vec``'s, a list given to
``BoltzLabsVecEnv``) into an env directory: ``factories.pkl``, cloudpickled here, in the trusted
trainer, and an ``env.py`` that unpickles and serves them inside each sandbox
(:func:`boltzlabs_gym.envside.gym_start.serve_factories`). What the sandbox cannot import travels
by value: the user's own modules (scripts, test files, source trees), and SB3's ``Monitor`` and
``_patch_env`` as calls to loaders that get them without importing torch.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..envside.factories import sb3_monitor_class, sb3_patch_env
from ..envside.gym_start import FACTORIES_FILE

__all__ = ["write_factory_env_dir", "torch_free_reduce", "FACTORIES_FILE", "ENV_PY", "PICKLE_PROTOCOL"]

#: The ``env.py`` of a factory env directory.
ENV_PY = "from boltzlabs_gym.envside.gym_start import serve_factories\n\nserve_factories()\n"
#: Pickle protocol for ``factories.pkl`` (fixed, so the same factories give the same bytes).
PICKLE_PROTOCOL = 5


def write_factory_env_dir(path: str | os.PathLike, factories: Callable[[], Any] | Sequence[Callable[[], Any]]) -> str:
    """Write an env directory that serves Gymnasium envs built by ``factories``.

    ``factories`` is one zero-arg callable or a list of them (env ``i`` of a pool uses
    ``factories[i % len(factories)]``). Writes ``factories.pkl`` (cloudpickle, fixed
    protocol) and an ``env.py`` that calls
    :func:`~boltzlabs_gym.envside.gym_start.serve_factories`; creates ``path``
    if needed and returns it. Same factories, same bytes, as far as cloudpickle is
    deterministic (it is for module-level functions and ``functools.partial`` of
    them; lambdas and closures can vary between interpreter runs).
    """
    import cloudpickle

    if callable(factories):
        factories = [factories]
    factories = list(factories)
    if not factories or not all(callable(f) for f in factories):
        raise TypeError("factories must be a callable or a non-empty list of callables")
    if all(f is factories[0] for f in factories):
        # One factory for every env (make_vec's [factory] * n): the same directory, and so the same
        # content hash, whatever n is; a snapshot of one such pool restores into another.
        factories = factories[:1]
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    data = _dumps_with_user_modules_by_value(cloudpickle, factories)
    for name, content in ((FACTORIES_FILE, data), ("env.py", ENV_PY.encode())):
        target = os.path.join(path, name)
        tmp = target + ".tmp"
        with open(tmp, "wb") as f:
            f.write(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    return path


def _installed_roots() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(r + os.sep for r in roots)


def _user_modules() -> list:
    """Modules of the user's own code: not stdlib, not installed packages, not ours.

    The sandbox has the trainer's interpreter and site-packages, but not the user's
    scripts, test modules or source trees, so code from those must travel by value.
    """
    roots = _installed_roots()
    found = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or name == "__main__" or name.split(".")[0] in ("boltzlabs_gym", "boltzlabs"):
            continue
        if os.path.realpath(file).startswith(roots):
            continue
        found.append(module)
    return found


def _dumps_with_user_modules_by_value(cloudpickle, factories: list) -> bytes:
    registered = []
    for module in _user_modules():
        try:
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
        except (ValueError, TypeError):
            pass
    try:
        return _dumps_torch_free(cloudpickle, factories)
    finally:
        for module in registered:
            try:
                cloudpickle.unregister_pickle_by_value(module)
            except (ValueError, TypeError):
                pass


def _dumps_torch_free(cloudpickle, obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, with SB3's ``Monitor`` and ``_patch_env`` pickled so that the env
    process gets them without importing Stable-Baselines3 and torch (:func:`torch_free_reduce`).
    Nothing changes for factories that hold neither: same objects, same bytes."""

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, value: Any) -> Any:
            return torch_free_reduce(value) or super().reducer_override(value)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=PICKLE_PROTOCOL).dump(obj)
    return buffer.getvalue()


#: SB3 objects that env factories often hold (SB3's ``Monitor``; ``make_vec_env``'s env recipe
#: holds it and ``_patch_env``), by ``(module, qualname)``, and the torch-free loader an env
#: process gets each from instead of importing their module (see :func:`torch_free_reduce`;
#: the loaders run in the env process, so they live in :mod:`boltzlabs_gym.envside.factories`).
_TORCH_FREE = {
    ("stable_baselines3.common.monitor", "Monitor"): sb3_monitor_class,
    ("stable_baselines3.common.vec_env.patch_gym", "_patch_env"): sb3_patch_env,
}


def torch_free_reduce(obj: Any) -> tuple[Callable, tuple] | None:
    """How to pickle ``obj`` so that unpickling it does not import Stable-Baselines3 (and torch).

    Importing any SB3 module runs ``stable_baselines3/__init__.py``, which imports torch: about
    3 s of CPU and 160 MiB in every env process that unpickles a factory holding SB3's
    ``Monitor`` (``lambda: Monitor(gym.make(...))``, every ``make_vec_env`` env). Those objects
    are pickled as a call to the loader that gets them without it; ``None`` for anything else.

    >>> torch_free_reduce(len) is None
    True
    """
    if not isinstance(obj, type) and not callable(obj):
        return None
    try:
        key = (obj.__module__, obj.__qualname__)
    except AttributeError:
        return None
    loader = _TORCH_FREE.get(key) if isinstance(key[0], str) and key[0].startswith("stable_baselines3.") else None
    return None if loader is None else (loader, ())
