"""The public surface, pinned (as trio's and httpx's test_exports do): a change to it is a decision, made here."""

from __future__ import annotations

import ast
import glob
import importlib
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
    "AuthConfigError",
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


#: The ``__all__`` of each public module. The vector env is a package (``boltzlabs_gym.vector``)
#: whose public modules are ``vec_env``, ``gym_errors``, ``send_recv`` and ``make``.
MODULE_EXPORTS = {
    "boltzlabs_gym.vector": [
        "ActionBatchError",
        "AlreadyPendingCallError",
        "AsyncState",
        "BoltzLabsVecEnv",
        "ClosedEnvironmentError",
        "NoAsyncCallError",
        "SubEnvSpaceError",
        "VectorTimeoutError",
        "make_vec",
    ],
    "boltzlabs_gym.vector.vec_env": ["BoltzLabsVecEnv"],
    "boltzlabs_gym.vector.gym_errors": [
        "ActionBatchError",
        "AlreadyPendingCallError",
        "ClosedEnvironmentError",
        "NoAsyncCallError",
        "SubEnvSpaceError",
        "VectorTimeoutError",
    ],
    "boltzlabs_gym.vector.make": ["make_vec", "register_envs", "vector_entry_point"],
    "boltzlabs_gym.vector.send_recv": ["SendRecv", "check_batch_size"],
    "boltzlabs_gym.errors": [
        "ArchiveError",
        "AsyncStateError",
        "AuthConfigError",
        "BoltzLabsError",
        "CapacityError",
        "CodecError",
        "EnvAttributeError",
        "EnvCallError",
        "EnvStartError",
        "KeyFileError",
        "MetricsPortError",
        "MissingExtraError",
        "NetnsUnavailable",
        "PlacementTimeout",
        "PoolClosedError",
        "ProtocolError",
        "SandboxUnavailable",
        "SnapshotError",
        "WorkerError",
        "WorkerLost",
        "WorkerTimeout",
    ],
    "boltzlabs_gym.sb3": ["BoltzLabsSB3VecEnv", "make_sb3_vec_env"],
    "boltzlabs_gym.aio": ["AsyncEnv", "AsyncPool"],
    "boltzlabs_gym.client.pool": ["ERROR", "EnvResult", "MODES", "OK", "RLPool", "STRAGGLER", "parse_result"],
    "boltzlabs_gym.client.snapshot": ["SNAPSHOT_FILE_MAGIC", "Snapshot"],
    "boltzlabs_gym.client.stats": ["PoolRecorder", "PoolStats", "PssReport", "measure_pss"],
    "boltzlabs_gym.testing": [
        "CODE_ENV_BROKEN",
        "CODE_ENV_GOOD",
        "CODE_ENV_WRONG",
        "NetnsHost",
        "NetnsUnavailable",
        "WorkerProcess",
        "alive",
        "pids_gone",
        "wait_until",
    ],
    "boltzlabs_gym.ray": ["RayWorker", "RayWorkers", "StartupTimes", "WorkerHost", "worker_environment"],
    "boltzlabs_gym.code": [
        "AsyncCodeRunner",
        "CodeRunner",
        "CommandResult",
        "Grade",
        "LANGUAGES",
        "QueueFullError",
        "RUNNER_ENV_DIR",
        "RunRequest",
        "RunResult",
        "RunnerStats",
        "assert_requests",
        "judge_asserts",
        "judge_stdio",
        "run_status",
        "stdio_requests",
    ],
}


#: What :class:`~boltzlabs_gym.RLPool` offers besides the attributes its constructor sets: the
#: calls users make. Adapter-only calls live on the parts the pool owns (``pool.batch_calls``,
#: ``pool.snapshot_keeper``), not here.
POOL_SURFACE = [
    "async_steps",  # the part behind send/recv, as batch_calls is behind step
    "batch_async",
    "batch_wait",
    "call_envs",
    "cancels",  # cancelling tagged calls in flight on a connection of its own
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


def test_type_checkers_see_every_lazy_name_from_where_it_loads():
    """The package's names load on first use; its ``if TYPE_CHECKING:`` imports are what mypy and
    editors see of them (without them ``boltzlabs_gym.make_vec`` is ``Any`` to a type checker)."""
    tree = ast.parse(open(boltzlabs_gym.__file__).read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {
        alias.name: "boltzlabs_gym." + node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    }
    assert seen == boltzlabs_gym._LAZY


def test_dir_lists_the_exports_and_unknown_names_raise():
    assert set(PACKAGE_EXPORTS) <= set(dir(boltzlabs_gym))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        boltzlabs_gym.NoSuchThing  # noqa: B018


def test_every_exception_in_errors_is_exported_except_the_test_helpers():
    from boltzlabs_gym import errors

    assert set(errors.__all__) - set(boltzlabs_gym.__all__) == {"NetnsUnavailable"}


@pytest.mark.parametrize("module", sorted(MODULE_EXPORTS))
def test_public_module_exports_are_pinned(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == MODULE_EXPORTS[module]
    assert len(set(mod.__all__)) == len(mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name}"


def test_the_vector_package_and_the_package_export_the_same_objects():
    import boltzlabs_gym.vector as vector

    assert vector.BoltzLabsVecEnv is boltzlabs_gym.BoltzLabsVecEnv
    assert vector.make_vec is boltzlabs_gym.make_vec
    for name in MODULE_EXPORTS["boltzlabs_gym.vector.gym_errors"]:
        assert getattr(vector, name) is getattr(importlib.import_module("boltzlabs_gym.vector.gym_errors"), name)


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


ADAPTERS = [
    *sorted(glob.glob("boltzlabs_gym/vector/*.py", root_dir=ROOT)),
    "boltzlabs_gym/sb3.py",
    "boltzlabs_gym/client/snapshot.py",
]


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
