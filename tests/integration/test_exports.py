"""The public surface, pinned (as trio's and httpx's test_exports do): a change to it is a decision, made here."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

import boltzlabs_gym
import boltzlabs_gym.env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PACKAGE_EXPORTS = [
    "ArchiveError",
    "AsyncStateError",
    "BoltzLabsError",
    "BoltzLabsVecEnv",
    "CapacityError",
    "CodecError",
    "EnvAttributeError",
    "EnvCallError",
    "EnvStartError",
    "IsolationReport",
    "KeyFileError",
    "Limits",
    "MetricsPortError",
    "MissingExtraError",
    "PlacementTimeout",
    "PoolClosedError",
    "PoolOptions",
    "PoolStats",
    "ProtocolError",
    "RLPool",
    "SandboxUnavailable",
    "Snapshot",
    "SnapshotError",
    "Timing",
    "WorkerError",
    "WorkerLost",
    "WorkerTimeout",
    "__version__",
    "make_vec",
]

#: What env code may use: ``from boltzlabs_gym.env import serve`` (or ``boltzlabs.env``).
ENV_EXPORTS = [
    "ENV_DIR",
    "ENV_INDEX",
    "ProtocolError",
    "WORKSPACE",
    "measurement",
    "read_message",
    "serve",
    "write_message",
]


#: What :class:`~boltzlabs_gym.RLPool` offers besides the attributes its constructor sets: the
#: calls users make. Adapter-only calls live on the parts the pool owns (``pool.batch_calls``,
#: ``pool.snapshot_keeper``), not here.
POOL_SURFACE = [
    "async_steps",  # the part behind send/recv (issue #32), as batch_calls is behind step
    "batch_async",
    "batch_wait",
    "call_envs",
    "cancels",  # cancelling tagged calls in flight on a connection of its own (issue #33)
    "close",
    "closed",
    "envs_per_gb",
    "fork",
    "lost_workers",
    "memory",
    "recv",
    "reset",
    "restore",
    "send",
    "snapshot",
    "stats",
    "step",
    "step_async",
    "step_wait",
    "timing",
    "uploads",
    "workers",
]


def test_package_exports_are_pinned():
    assert sorted(boltzlabs_gym.__all__) == PACKAGE_EXPORTS
    assert len(set(boltzlabs_gym.__all__)) == len(boltzlabs_gym.__all__)


@pytest.mark.parametrize("name", PACKAGE_EXPORTS)
def test_each_package_export_resolves(name):
    value = getattr(boltzlabs_gym, name)
    assert value is not None
    if isinstance(value, type):
        assert value.__module__.startswith("boltzlabs_gym."), value.__module__


def test_dir_lists_the_exports_and_unknown_names_raise():
    assert set(PACKAGE_EXPORTS) <= set(dir(boltzlabs_gym))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        boltzlabs_gym.NoSuchThing  # noqa: B018


def test_every_exception_in_errors_is_exported_except_the_test_helpers():
    from boltzlabs_gym import errors

    assert set(errors.__all__) - set(boltzlabs_gym.__all__) == {"NetnsUnavailable"}


def test_env_exports_are_pinned():
    assert sorted(boltzlabs_gym.env.__all__) == ENV_EXPORTS
    for name in ENV_EXPORTS:
        assert hasattr(boltzlabs_gym.env, name), name


def test_boltzlabs_env_alias_is_the_same_module_surface():
    import boltzlabs.env

    for name in ENV_EXPORTS:
        assert getattr(boltzlabs.env, name) is getattr(boltzlabs_gym.env, name), name


def test_env_side_imports_only_the_standard_library():
    """Inside every sandbox the env side is imported before any env code: nothing heavy, nothing third-party."""
    code = (
        "import json, sys; before = set(sys.modules); import boltzlabs_gym.env; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    env = dict(
        os.environ,
        BOLTZLABS_ENV_INDEX="0",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    foreign = [
        m for m in loaded if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "boltzlabs_gym"
    ]
    assert foreign == [], f"the env side pulled in {foreign}"


def test_rlpool_methods_are_pinned():
    assert sorted(name for name in dir(boltzlabs_gym.RLPool) if not name.startswith("_")) == POOL_SURFACE


def _names_a_pool(node: ast.expr) -> bool:
    """``pool``, ``self.pool``, ``self._pool``, ``envs.pool``, ``self.venv.pool``..."""
    return (isinstance(node, ast.Name) and node.id == "pool") or (
        isinstance(node, ast.Attribute) and node.attr in ("pool", "_pool")
    )


ADAPTERS = ["boltzlabs_gym/vector.py", "boltzlabs_gym/sb3.py", "boltzlabs_gym/client/snapshot.py"]


@pytest.mark.parametrize("path", ADAPTERS)
def test_adapters_and_snapshot_handles_use_only_the_pools_public_names(path):
    """The adapters and the Snapshot handle reach a pool through its public names alone: what they
    need of its parts, they ask the part (``pool.batch_calls``, ``pool.snapshot_keeper``)."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    private = sorted(
        {
            f"line {node.lineno}: .{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _names_a_pool(node.value)
        }
    )
    assert private == [], f"{path} uses a pool's private names: {private}"
