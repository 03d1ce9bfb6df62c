"""A factory's exception keeps its type across the sandbox, as names, never as a pickle.

``except gymnasium.error.DeprecatedEnv`` and ``except EnvStartError`` both catch an env whose
factory raised ``DeprecatedEnv``, as they do around ``DummyVecEnv`` (where the factory runs in
the trainer); names the trainer does not know, or classes it must not raise, leave a plain
``EnvStartError``; what a sandbox says is bounded and checked like any other reply.
"""

from __future__ import annotations

import json
import pickle

import gymnasium as gym
import pytest

import boltzlabs_gym
from boltzlabs_gym import BoltzLabsVecEnv, EnvStartError
from boltzlabs_gym.client.start_errors import start_error
from boltzlabs_gym.wire.start_failure import (
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    MAX_TYPES,
    describe_start_failure,
    parse_start_failure,
)

from conftest import ISOLATION


class LevelMissing(KeyError):
    """A user's own class: only its known base can be raised in the trainer."""


def deprecated_env():
    return gym.make("CliffWalking-v0")  # Gymnasium >= 1.2: DeprecatedEnv, use v1


def missing_level():
    raise LevelMissing("level 3")


def leaves_quietly():
    raise SystemExit(3)


# --------------------------------------------------------------------------- the names, in the trainer


@pytest.mark.parametrize(
    "types, also",
    [
        (["gymnasium.error.DeprecatedEnv", "gymnasium.error.Error", "builtins.Exception"], gym.error.DeprecatedEnv),
        (["test_start_errors.LevelMissing", "builtins.KeyError", "builtins.LookupError"], KeyError),
        (["builtins.ModuleNotFoundError", "builtins.ImportError"], ModuleNotFoundError),
        (["builtins.OSError"], OSError),
        (["builtins.UnicodeDecodeError", "builtins.UnicodeError"], UnicodeDecodeError),
    ],
)
def test_the_first_known_name_gives_the_second_base(types, also):
    exc = start_error("env 1 failed to start: ...", index=1, stderr_tail="Traceback ...", worker="ipc://w", types=types)
    assert isinstance(exc, EnvStartError) and isinstance(exc, also)
    assert str(exc) == "env 1 failed to start: ..."  # not KeyError's quoting, not OSError's errno
    assert (exc.index, exc.stderr_tail, exc.worker) == (1, "Traceback ...", "ipc://w")
    assert type(exc).__name__ == f"EnvStartError[{also.__name__}]"
    assert type(start_error("again", types=types)) is type(exc)  # one class per base


@pytest.mark.parametrize(
    "types",
    [
        [],
        ["mypkg.Unknown"],
        ["builtins.RuntimeError"],  # an EnvStartError is one already
        ["builtins.StopIteration", "builtins.Exception"],  # would end a loop, not report a failure
        ["builtins.SystemExit", "builtins.BaseException"],  # not an Exception: would end the trainer
        ["builtins.KeyboardInterrupt"],
        ["builtins.ExceptionGroup"],
        ["os.system", "builtins.eval", "pickle.loads"],  # names are looked up, never imported or called
        [123, None, {"__reduce__": 1}],
    ],
)
def test_unknown_or_unsafe_names_leave_a_plain_env_start_error(types):
    assert type(start_error("m", types=types)) is EnvStartError


def test_a_typed_start_error_pickles_and_comes_back_the_same():
    exc = start_error("m", 2, "tail", "tcp://h:1", types=["gymnasium.error.NameNotFound"])
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and isinstance(back, gym.error.NameNotFound)
    assert (str(back), back.index, back.stderr_tail, back.worker) == ("m", 2, "tail", "tcp://h:1")


# --------------------------------------------------------------------------- the line, on the wire


def test_the_line_names_the_class_and_its_bases_most_derived_first():
    failure = parse_start_failure(describe_start_failure(LevelMissing("level 3")))
    assert failure is not None
    assert failure.types[:3] == ("test_start_errors.LevelMissing", "builtins.KeyError", "builtins.LookupError")
    assert failure.message == "'level 3'"
    assert failure.reason == "its env factory raised LevelMissing: 'level 3'"


@pytest.mark.parametrize(
    "line",
    [
        b'{"obs": 1}\n',
        b'{"start_error": not json\n',
        b'{"start_error": []}\n',
        b'{"start_error": {"types": "builtins.KeyError"}}\n',
        b"",
    ],
)
def test_other_replies_are_not_start_failures(line):
    assert parse_start_failure(line) is None


def test_what_a_sandbox_says_is_bounded():
    hostile = {"start_error": {"types": ["x" * 10_000] * 1000 + [7], "message": "m" * 100_000}}
    failure = parse_start_failure(json.dumps(hostile).encode())
    assert failure is not None
    assert len(failure.types) == MAX_TYPES and all(len(t) == MAX_NAME_CHARS for t in failure.types)
    assert len(failure.message) == MAX_MESSAGE_CHARS


# --------------------------------------------------------------------------- end to end, through sandboxes


@pytest.mark.parametrize("options", [{}, {"envs_per_sandbox": 2}, {"mode": "boltz"}], ids=["default", "k2", "boltz"])
def test_a_gymnasium_error_is_caught_by_its_class_and_as_env_start_error(no_leaks, options):
    with pytest.raises(gym.error.DeprecatedEnv) as info:
        BoltzLabsVecEnv([deprecated_env] * 2, isolation=ISOLATION, **options)
    exc = info.value
    assert isinstance(exc, EnvStartError) and exc.index in (0, 1)
    assert f"env {exc.index} failed to start: its env factory raised DeprecatedEnv" in str(exc)
    # the sandbox's traceback, in the message and on the exception
    assert "Traceback (most recent call last)" in exc.stderr_tail
    assert "gymnasium.error.DeprecatedEnv: Environment version v0" in str(exc)


def test_a_users_class_arrives_as_its_nearest_known_base(no_leaks):
    with pytest.raises(KeyError) as info:
        boltzlabs_gym.make_vec(missing_level, num_envs=1, isolation=ISOLATION)
    assert isinstance(info.value, EnvStartError) and not isinstance(info.value, LevelMissing)
    assert "its env factory raised LevelMissing: 'level 3'" in str(info.value)


def test_a_factory_that_exits_is_a_plain_start_failure(no_leaks):
    with pytest.raises(EnvStartError) as info:
        BoltzLabsVecEnv([leaves_quietly], isolation=ISOLATION)
    assert type(info.value) is EnvStartError and "exited with status 3" in str(info.value)
