"""Env factories that the adapters cloudpickle into every sandbox.

A factory is pickled by reference to its module, so unpickling it inside the env
process imports that module. These live here, not next to ``make_vec`` or the SB3
adapter, because those modules import the trainer side (ZeroMQ, the pool,
Stable-Baselines3 and with it torch): an env process that imported them paid about
2 s of start-up and 180 MiB of memory for code it never runs. This module imports
Gymnasium only, and only when a factory is called.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["make_env", "SB3EnvFactory", "sb3_monitor_class", "sb3_patch_env"]


def make_env(env_id: str | Callable, env_kwargs: dict, wrappers: Sequence[Callable] | None = None):
    """Build one env (a Gymnasium id or a callable) and apply ``wrappers`` to it, in order.

    >>> env = make_env("CartPole-v1", {"max_episode_steps": 5}, [])
    >>> env.spec.max_episode_steps
    5
    """
    import gymnasium as gym

    env = env_id(**env_kwargs) if callable(env_id) else gym.make(env_id, **env_kwargs)
    for wrapper in wrappers or ():
        env = wrapper(env)
    return env


class SB3EnvFactory:
    """What ``make_sb3_vec_env`` sends each sandbox: SB3's ``make_vec_env`` recipe for one env
    (the env, then SB3's ``Monitor`` if asked, then ``wrapper_class``)."""

    def __init__(self, env_id: Any, env_kwargs: dict, wrapper_class: Callable | None, monitor: bool):
        self.env_id, self.env_kwargs, self.wrapper_class, self.monitor = env_id, env_kwargs, wrapper_class, monitor

    def __call__(self):
        env = make_env(self.env_id, self.env_kwargs)
        if self.monitor:
            env = sb3_monitor_class()(env)
        if self.wrapper_class is not None:
            env = self.wrapper_class(env)
        return env


def sb3_monitor_class() -> type:
    """Stable-Baselines3's ``Monitor`` wrapper, without importing torch where possible.

    ``stable_baselines3/__init__.py`` imports every algorithm, and so torch; its
    ``common/monitor.py`` needs only the standard library and Gymnasium. Unless SB3 is
    already imported, that one file is loaded on its own (the same class, under a private
    module name); if SB3's layout ever changes, the ordinary import is used.
    """
    return _sb3_file("common/monitor.py", "stable_baselines3.common.monitor").Monitor


def sb3_patch_env() -> Callable:
    """SB3's ``_patch_env`` (what ``make_vec_env`` applies to an env built by a callable), loaded
    as :func:`sb3_monitor_class` loads ``Monitor``: ``patch_gym.py`` needs Gymnasium only."""
    return _sb3_file("common/vec_env/patch_gym.py", "stable_baselines3.common.vec_env.patch_gym")._patch_env


def _sb3_file(path: str, module_name: str) -> Any:
    """SB3's module ``module_name`` if it is imported already, else its file ``path`` (relative to
    the package) loaded on its own under a private name, else (any surprise) the plain import."""
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        return loaded
    private_name = "_boltzlabs_sb3_" + module_name.rpartition(".")[2]
    private = sys.modules.get(private_name)
    if private is not None:
        return private
    try:
        package = importlib.util.find_spec("stable_baselines3")
        if package is None or package.origin is None:  # not installed: the plain import below says so
            raise ImportError("stable_baselines3 has no file to load beside its __init__")
        file = os.path.join(os.path.dirname(package.origin), *path.split("/"))
        spec = importlib.util.spec_from_file_location(private_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    except Exception:  # noqa: BLE001 - any surprise: the plain import, torch and all
        sys.modules.pop(private_name, None)
        return importlib.import_module(module_name)
