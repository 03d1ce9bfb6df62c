"""verl's compute_score and BaseTool, SkyRL's BaseTextEnv.

verl does not import beside trl (its dependencies pin transformers, huggingface_hub and packaging
below what trl installs), so CodeTool is tested against verl's own ``verl/tools/base_tool.py`` and
``schemas.py`` loaded from the verl 0.9.1 wheel that ``.ci/run`` downloads (no verl code is
committed); only ``verl.utils.rollout_trace.rollout_trace_op``, a tracing decorator, is stood in by an
identity. Skipped without the wheel.
"""

from __future__ import annotations

import asyncio
import glob
import importlib.util
import os
import sys
import types
import zipfile

import pytest
from conftest import ADD, ADD_TESTS, LOOP

from boltzlabs_gym.integrations import verl as bverl

VERL_DIST = os.environ.get("BOLTZLABS_VERL_DIST_DIR", ".cache/verl-dist")


def test_compute_score_both_styles_sync_async_and_batched(grader):
    bverl.configure(grader=grader)
    stdio = '{"inputs": ["2\\n"], "outputs": ["4"]}'
    assert bverl.compute_score("apps", f"```python\n{ADD}```", ADD_TESTS)["score"] == 1.0
    assert bverl.compute_score("apps", "print(int(input()) * 2)", stdio, extra_info={})["score"] == 1.0
    bad = bverl.compute_score("apps", ADD, "{nope")
    assert bad["score"] == 0.0 and bad["reason"].startswith("malformed")
    out = asyncio.run(bverl.compute_score_async("apps", LOOP, ADD_TESTS))
    assert out["score"] == 0.0 and out["cases"] == 3
    batch = bverl.compute_score(
        data_sources=["apps"] * 3, solution_strs=[ADD, LOOP, None], ground_truths=[ADD_TESTS] * 3, extra_infos=[{}] * 3
    )
    assert [b["score"] for b in batch] == [1.0, 0.0, 0.0]


def _load_verl_tools() -> None:
    wheels = sorted(glob.glob(os.path.join(VERL_DIST, "verl-*.whl")))
    if not wheels:
        pytest.skip(f"no verl wheel in {VERL_DIST}: pip download --no-deps verl==0.9.1 -d {VERL_DIST}")
    try:
        import verl.tools.base_tool  # noqa: F401  (verl installed and importable: use it as it is)

        return
    except ImportError:
        pass
    pytest.importorskip("pydantic")
    sources = {}
    with zipfile.ZipFile(wheels[-1]) as whl:
        for name in ("verl/tools/schemas.py", "verl/tools/base_tool.py"):
            sources[name] = whl.read(name).decode()
    for pkg in ("verl", "verl.tools", "verl.utils"):
        mod = types.ModuleType(pkg)
        mod.__path__ = []
        sys.modules[pkg] = mod
    trace = types.ModuleType("verl.utils.rollout_trace")
    trace.rollout_trace_op = lambda fn: fn  # verl's tracing decorator, nothing else
    sys.modules["verl.utils.rollout_trace"] = trace
    for name, source in sources.items():
        modname = name[:-3].replace("/", ".")
        spec = importlib.util.spec_from_loader(modname, loader=None)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "verl.tools"
        sys.modules[modname] = module
        exec(compile(source, name, "exec"), module.__dict__)


def test_verl_code_tool_against_verls_base_tool(grader, leases):
    _load_verl_tools()
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    bverl.configure(grader=grader, leases=leases)
    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "run_code",
                "description": "Run Python.",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
            },
        }
    )
    CodeTool = bverl.code_tool_class()
    assert issubclass(CodeTool, BaseTool)
    tool = CodeTool({"run_timeout": 1.0}, schema)

    async def trajectory():
        iid, _ = await tool.create(ground_truth=ADD_TESTS)
        response, step_reward, metrics = await tool.execute(iid, {"code": "print(6 * 7)"})
        assert "42" in response.text and step_reward == 0.0 and metrics["status"] == "Success"
        response, _, _ = await tool.execute(iid, {"code": 5})
        assert "must be a string" in response.text
        await tool.execute(iid, {"code": ADD})
        reward = await tool.calc_reward(iid)
        await tool.release(iid)
        return reward

    assert asyncio.run(trajectory()) == 1.0
    assert leases.leased == 0


def test_skyrl_env_registered_one_pool_env_per_trajectory(grader, leases):
    skyrl_gym = pytest.importorskip("skyrl_gym", reason="pip install 'boltzlabs-gym[skyrl]' (skyrl-gym==0.4.0)")
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    from boltzlabs_gym.integrations.skyrl import register

    env_id = register(leases, grader)
    extras = {"reward_spec": {"ground_truth": ADD_TESTS}, "max_turns": 2, "run_timeout": 1.0}
    env = skyrl_gym.make(env_id, env_config=None, extras=extras)
    assert isinstance(env, BaseTextEnv)
    prompt = [{"role": "user", "content": "write add"}]
    assert env.init(prompt)[0] == prompt and leases.leased == 1
    first = env.step("```python\nprint('hi', flush=True)\nwhile True: pass\n```")
    [seen] = first["observations"]
    assert not first["done"] and "TimeLimitExceeded" in seen["content"] and "hi" in seen["content"]
    last = env.step(f"```python\n{ADD}```")
    assert last["done"] and last["reward"] == 1.0
    env.close()
    assert leases.leased == 0
