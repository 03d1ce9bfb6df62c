"""One reading of env results: the same failure shape through every adapter.

The first half reads hand-made results (no sandbox); the second drives one hanging and one
crashing env through ``RLPool``, ``BoltzLabsVecEnv`` and the SB3 adapter and checks that each
reports them the same way: truncated (not terminated), zero reward, and the same info dict.
"""

from __future__ import annotations

import functools
import shutil
import tempfile

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from boltzlabs_gym import BoltzLabsVecEnv, RLPool
from boltzlabs_gym.errors import BoltzLabsError, EnvAttributeError, EnvCallError
from boltzlabs_gym.wire.protocol import ERROR, OK, STRAGGLER
from boltzlabs_gym.client.results import (
    ERROR_KEY,
    STRAGGLER_KEY,
    EnvResult,
    FailureKind,
    parse_result,
    read_reset,
    read_step,
    read_value,
)

from conftest import ISOLATION
from vector_envs import FlakyCartPole

FAILURE_FIELDS = {"kind", "reason", "stderr", "deadline_s"}


def _result(status=OK, reply=None, index=0, payloads=()):
    return EnvResult(index=index, status=status, reply=reply, payloads=list(payloads))


# ---------------------------------------------------------------------- reading, no sandbox
def test_a_step_that_answered_is_read_as_sent():
    t = read_step(_result(reply={"obs": [1, 2], "reward": 2, "terminated": True, "info": {"a": 1}}))
    assert (t.obs, t.reward, t.terminated, t.truncated, t.info, t.failure) == ([1, 2], 2.0, True, False, {"a": 1}, None)
    assert t.reset_obs is None and t.reset_info is None


def test_the_old_done_key_still_means_terminated():
    assert read_step(_result(reply={"obs": 0, "reward": 0, "done": True})).terminated


@pytest.mark.parametrize(
    "status, reply, kind, key",
    [
        (STRAGGLER, {"message": "env 0 missed the 1 s deadline for 'step'"}, FailureKind.STRAGGLER, STRAGGLER_KEY),
        (ERROR, {"message": "the env exited with status 7", "stderr": "boom\n"}, FailureKind.CRASH, ERROR_KEY),
        (OK, {"error": "action 9 is not in Discrete(2)"}, FailureKind.REFUSED, ERROR_KEY),
        (OK, {"obs": 0, "reward": "lots"}, FailureKind.BAD_REPLY, ERROR_KEY),
    ],
    ids=["straggler", "crash", "refused", "bad_reward"],
)
def test_every_failed_step_is_truncated_with_one_info_shape(status, reply, kind, key):
    t = read_step(_result(status, reply, index=5), deadline_s=1.0)
    assert t.failure is not None and t.failure.kind is kind and t.failure.index == 5
    assert (t.obs, t.reward, t.terminated, t.truncated) == (None, 0.0, False, True)
    assert set(t.info[key]) == FAILURE_FIELDS and t.info[key]["kind"] == kind.value
    assert t.info[key]["deadline_s"] == (1.0 if kind is FailureKind.STRAGGLER else None)
    other = ERROR_KEY if key == STRAGGLER_KEY else STRAGGLER_KEY
    assert other not in t.info


def test_a_crash_keeps_its_stderr_tail_for_humans():
    t = read_step(_result(ERROR, {"message": "the env exited with status 7", "stderr": "Traceback...\nboom\n"}))
    assert t.info[ERROR_KEY]["stderr"] == "Traceback...\nboom\n"
    assert t.failure.describe() == "the env exited with status 7\n--- stderr tail ---\nTraceback...\nboom"


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]"], ids=["not_json", "not_an_object"])
def test_an_unreadable_reply_line_is_a_bad_reply(raw):
    r = parse_result(EnvResult(index=2, status=OK, reply=None, payloads=[], raw=raw))
    t = read_step(r)
    assert t.failure.kind is FailureKind.BAD_REPLY and t.truncated and not t.terminated


def test_an_observation_the_decoder_refuses_is_a_bad_reply_and_keeps_the_env_info():
    def decode(obj, payloads):
        raise ValueError("expected 4 floats")

    t = read_step(_result(reply={"obs": [1], "reward": 1.0, "info": {"x": 1}}), decode_obs=decode)
    assert t.failure.kind is FailureKind.BAD_REPLY and "expected 4 floats" in t.failure.reason
    assert t.info["x"] == 1 and t.info[ERROR_KEY]["kind"] == "bad_reply"


def test_a_same_step_reset_is_read_with_the_step():
    t = read_step(_result(reply={"obs": 1, "reward": 1, "terminated": True, "reset_obs": 0, "reset_info": {"r": 1}}))
    assert t.terminated and t.reset_obs == 0 and t.reset_info == {"r": 1}


def test_resets_fail_the_same_way():
    out = read_reset(_result(STRAGGLER, {"message": "missed the 2 s deadline for 'reset'"}), deadline_s=2.0)
    assert out.obs is None and out.failure.kind is FailureKind.STRAGGLER
    assert out.info[STRAGGLER_KEY]["deadline_s"] == 2.0
    refused = read_reset(_result(OK, {"error": "unknown option"}))
    assert refused.failure.kind is FailureKind.REFUSED and "refused the reset" in refused.info[ERROR_KEY]["reason"]
    ok = read_reset(_result(OK, {"obs": 3, "info": {"seed": 1}}))
    assert ok == (3, {"seed": 1}, None)


def test_values_and_their_errors():
    assert read_value(_result(reply={"value": 7}), "get_attr('x')") == 7
    with pytest.raises(EnvAttributeError, match="env 3: get_attr") as exc:
        read_value(_result(reply={"error": "Traceback\nAttributeError: no attribute 'x'"}, index=3), "get_attr('x')")
    assert isinstance(exc.value, AttributeError) and exc.value.index == 3
    with pytest.raises(EnvCallError, match="failed inside the env") as exc:
        read_value(_result(reply={"error": "Traceback\nValueError: no"}), "call('f')")
    assert isinstance(exc.value, RuntimeError) and isinstance(exc.value, BoltzLabsError)
    with pytest.raises(EnvCallError, match=r"env 1: render failed \(crash\)") as exc:
        read_value(_result(ERROR, {"message": "killed by signal 9"}, index=1), "render")
    assert exc.value.failure.kind is FailureKind.CRASH


# ---------------------------------------------------------------------- the same through every adapter
N, HANG, CRASH = 4, 1, 2


def _factories():
    fault = {HANG: "hang", CRASH: "crash"}
    return [functools.partial(FlakyCartPole, i, i if i in fault else -1, fault.get(i, "none"), 2) for i in range(N)]


def _assert_reported(failed: dict, truncated: dict, terminated: dict, rewards):
    """``failed[i]`` is env i's failure info entry (the dict under its key)."""
    assert set(failed) == {HANG, CRASH}
    assert set(failed[HANG]) == FAILURE_FIELDS and set(failed[CRASH]) == FAILURE_FIELDS
    assert failed[HANG]["kind"] == "straggler" and failed[HANG]["deadline_s"] == 1.0
    assert "deadline" in failed[HANG]["reason"]
    assert failed[CRASH]["kind"] == "crash" and "exited with status 9" in failed[CRASH]["reason"]
    assert failed[CRASH]["deadline_s"] is None
    for i in (HANG, CRASH):
        assert truncated[i] and not terminated[i] and rewards[i] == 0


@pytest.fixture
def flaky_env_dir():
    from boltzlabs_gym.vector.factory_env_dir import write_factory_env_dir

    path = tempfile.mkdtemp(prefix="flaky-envdir-")
    write_factory_env_dir(path, _factories())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _two_steps(step):
    step()
    return step()


def test_rlpool_reports_failures_in_the_shared_shape(no_leaks, flaky_env_dir):
    with RLPool(flaky_env_dir, n=N, isolation=ISOLATION, step_timeout=1.0) as pool:
        pool.reset(seed=0)
        obs, rewards, dones, infos = _two_steps(lambda: pool.step([0] * N))
        failed = {i: info.get(STRAGGLER_KEY) or info.get(ERROR_KEY) for i, info in enumerate(infos)}
        failed = {i: f for i, f in failed.items() if f}
        # RLPool returns dones; the failed envs' episodes end by truncation, as everywhere.
        _assert_reported(failed, dones, {i: False for i in range(N)}, rewards)
        assert obs[HANG] is None and obs[CRASH] is None


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.value)
def test_vector_env_reports_failures_in_the_shared_shape(no_leaks, mode):
    envs = BoltzLabsVecEnv(_factories(), autoreset_mode=mode, isolation=ISOLATION, step_timeout=1.0)
    try:
        envs.reset(seed=0)
        obs, rewards, terms, truncs, infos = _two_steps(lambda: envs.step(np.zeros(N, dtype=np.int64)))
        failed = {}
        for key in (STRAGGLER_KEY, ERROR_KEY):
            for i in np.flatnonzero(infos.get(f"_{key}", np.zeros(N, bool))):
                failed[int(i)] = {field: infos[key][field][i] for field in infos[key] if not field.startswith("_")}
        _assert_reported(failed, truncs, terms, rewards)
    finally:
        envs.close()


def test_sb3_adapter_reports_failures_in_the_shared_shape(no_leaks):
    from boltzlabs_gym.sb3 import BoltzLabsSB3VecEnv

    venv = BoltzLabsVecEnv(_factories(), autoreset_mode=AutoresetMode.SAME_STEP, isolation=ISOLATION, step_timeout=1.0)
    env = BoltzLabsSB3VecEnv(venv)
    try:
        env.reset()
        obs, rewards, dones, infos = _two_steps(lambda: env.step(np.zeros(N, dtype=np.int64)))
        failed = {i: info.get(STRAGGLER_KEY) or info.get(ERROR_KEY) for i, info in enumerate(infos)}
        failed = {i: f for i, f in failed.items() if f}
        truncated = {i: info["TimeLimit.truncated"] for i, info in enumerate(infos)}
        _assert_reported(failed, truncated, {i: not truncated[i] and dones[i] for i in range(N)}, rewards)
        assert env.straggler_count == 1 and env.error_count == 1
    finally:
        env.close()
