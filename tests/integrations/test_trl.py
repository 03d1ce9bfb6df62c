"""TRL: the reward functions and the environment class, against the real trl package."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from conftest import ADD, ADD_TESTS, LOOP

pytest.importorskip("trl", reason="pip install 'boltzlabs-gym[trl]' (trl==1.16.0)")

from trl.trainer.utils import get_callable_name, is_async_callable  # noqa: E402

from boltzlabs_gym.integrations.trl import AsyncCodeReward, CodeReward, code_environment  # noqa: E402


def test_reward_functions_sync_and_async_read_tests_from_the_column(grader):
    logged = {}
    sync, asyn = CodeReward(grader), AsyncCodeReward(grader, name="boltz_async")
    assert get_callable_name(sync) == "boltz_code" and not is_async_callable(sync) and is_async_callable(asyn)
    kwargs = {"tests": [ADD_TESTS, ADD_TESTS, "{broken", ADD_TESTS], "log_extra": lambda k, v: logged.update({k: v})}
    completions = [ADD, LOOP, ADD, 7]
    assert sync(["p"] * 4, completions, **kwargs) == [1.0, 0.0, None, 0.0]
    assert logged["boltz_code_reason"][2].startswith("malformed test cases")
    assert asyncio.run(asyn(["p"] * 4, completions, **kwargs)) == [1.0, 0.0, None, 0.0]
    assert sync(["p"], [ADD]) == [None], "no tests column: the reward does not apply"


def test_environment_holds_one_pool_env_per_rollout(grader, leases):
    from transformers.utils import get_json_schema

    Env = code_environment(leases, grader, run_timeout=1.0)
    tools = [n for n, _ in inspect.getmembers(Env, inspect.isfunction) if not n.startswith("_")]
    assert sorted(tools) == ["get_reward", "reset", "run_code"]  # TRL's tools: run_code alone
    schema = get_json_schema(Env().run_code)  # what TRL renders into the prompt
    assert schema["function"]["parameters"]["properties"]["code"]["type"] == "string"
    a, b = Env(), Env()
    a.reset(prompt="x", tests=ADD_TESTS)
    b.reset(prompt="y", tests=ADD_TESTS)
    assert leases.leased == 2
    assert "Success" in a.run_code("open('mine.txt', 'w').write('a')")
    assert "True" in a.run_code("import os; print(os.path.exists('mine.txt'))")  # the rollout's files stay
    assert "False" in b.run_code("import os; print(os.path.exists('mine.txt'))")  # another rollout's do not
    assert "TimeLimitExceeded" in b.run_code("while True: pass")
    assert b.get_reward() == 0.0
    a.run_code(ADD)
    assert a.get_reward() == 1.0
    a.reset(tests=ADD_TESTS)  # a new rollout: a fresh env
    assert "False" in a.run_code("import os; print(os.path.exists('mine.txt'))")
    del a, b
    assert leases.leased == 0, "a dropped environment gives its env back"
