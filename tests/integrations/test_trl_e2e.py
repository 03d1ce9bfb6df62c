"""End to end with TRL: a real ``GRPOTrainer`` trains a few steps on CPU with rewards graded in the pool.

What is real: TRL 1.16's ``GRPOTrainer`` (generation, its reward call path with the dataset's
columns, the async-reward event loop, ``environment_factory`` pooling, ``reset(**row)`` per rollout
and ``get_reward`` as an extra reward, the GRPO loss and optimizer step), a tiny randomly
initialised Llama and a tokenizer built locally (``examples/trl_grpo_rewards.py``; nothing is
downloaded), the :class:`Grader`'s code runner and the :class:`EnvLeases` pool with their sandboxes.

What is fixed: a random model writes garbage, so the programs graded are not its text. Each row
names two programs (one per generation of its GRPO group); the reward functions given to the
trainer are thin wrappers that replace the completions with those programs and then call
:class:`CodeReward` / :class:`AsyncCodeReward` with everything else TRL passed (the ``tests``
column, ``log_extra``). The random model never emits a tool call either, so the ``run_code`` tool
of each rollout's environment (the instances TRL created and reset with the row) is called by the
sync wrapper, through the ``environments`` TRL hands to reward functions; TRL then calls each
environment's ``get_reward``.

Among the programs: one that loops forever (documented reward 0.0: each case is killed on the
grader's ``run_timeout`` and fails) and one that reads a file the test wrote in its tmp dir by
absolute path (it passes its cases only if it read it; in the sandbox it reads nothing: 0.0).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import time

import pytest
from conftest import ADD, ADD_TESTS, LOOP

pytest.importorskip("trl", reason="pip install 'boltzlabs-gym[trl]' (trl==1.16.0)")

from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from boltzlabs_gym.integrations.leases import EnvLeases  # noqa: E402
from boltzlabs_gym.integrations.trl import AsyncCodeReward, CodeReward, code_environment  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "trainer-secret-5d1f"
#: Each row: the programs graded for its two generations. Over 4 steps of one prompt each (one
#: epoch), every row is seen once, so every program is graded, the loop and the hostile one twice.
PAIRS = [["good", "loop"], ["hostile", "wrong"], ["good", "hostile"], ["loop", "good"]]


def _example():
    path = os.path.join(ROOT, "examples", "trl_grpo_rewards.py")
    spec = importlib.util.spec_from_file_location("trl_grpo_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _programs(secret_path: str) -> dict[str, str]:
    hostile = (
        "import os\n"
        f"PATH = {secret_path!r}\n"
        "try:\n"
        "    stolen = open(PATH).read()\n"
        "except OSError:\n"
        "    stolen = ''\n"
        "seen = os.listdir(os.path.dirname(PATH)) if os.path.isdir(os.path.dirname(PATH)) else []\n"
        "print('STOLEN', stolen, seen)\n"
        "def add(a, b):\n"
        f"    return a + b if stolen == {SECRET!r} else None\n"
    )
    return {"good": ADD, "wrong": "def add(a, b):\n    return a - b\n", "loop": LOOP, "hostile": hostile}


class FixedPrograms:
    """Wraps a TRL reward: grades the row's fixed programs (see the module doc) instead of the completions,
    records each sample's program, score and the call's duration, and runs each program in its rollout's
    environment when TRL passes ``environments``."""

    def __init__(self, reward, programs: dict[str, str]):
        self.reward, self.programs = reward, programs
        self.__name__ = reward.__name__
        self.graded: list[tuple[str, float | None]] = []
        self.durations: list[float] = []
        self.tool_outputs: list[tuple[str, str]] = []

    def names(self, pairs: list[list[str]]) -> list[str]:
        # TRL puts a row's num_generations (2) copies next to each other: sample i grades its row's (i % 2)-th program.
        return [pair[i % len(pair)] for i, pair in enumerate(pairs)]

    def record(self, names, scores, t0):
        self.durations.append(time.perf_counter() - t0)
        self.graded += list(zip(names, scores))


class SyncFixed(FixedPrograms):
    def __call__(self, prompts, completions, pairs, environments=None, **kwargs):
        names, t0 = self.names(pairs), time.perf_counter()
        scores = self.reward(prompts, [self.programs[n] for n in names], **kwargs)
        self.record(names, scores, t0)
        for env, name in zip(environments or (), names):
            self.tool_outputs.append((name, env.run_code(self.programs[name] + "print(add(1, 2))\n")))
        return scores


class AsyncFixed(FixedPrograms):
    async def __call__(self, prompts, completions, pairs, **kwargs):
        names, t0 = self.names(pairs), time.perf_counter()
        scores = await self.reward(prompts, [self.programs[n] for n in names], **kwargs)
        self.record(names, scores, t0)
        return scores


@pytest.fixture(scope="module")
def rollout_leases():
    with EnvLeases(2) as leases:  # one env per rollout: 2 generations per step
        yield leases


def test_grpo_trainer_trains_on_sandboxed_rewards(grader, rollout_leases, tmp_path):
    secret = tmp_path / "trainer_secret.txt"
    secret.write_text(SECRET)
    programs = _programs(str(secret))
    # Control: outside the sandbox the hostile program does read the file (so 0.0 below means the sandbox).
    outside = subprocess.run([sys.executable, "-c", programs["hostile"] + "assert add(1, 2) == 3"], capture_output=True)
    assert outside.returncode == 0 and SECRET.encode() in outside.stdout

    example = _example()
    tokenizer = example.tiny_tokenizer()
    sync = SyncFixed(CodeReward(grader), programs)
    asyn = AsyncFixed(AsyncCodeReward(grader, name="boltz_async"), programs)
    Env = code_environment(rollout_leases, grader, run_timeout=grader.run_timeout)
    prompt = [{"role": "user", "content": "write code add a b"}]
    rows = [{"prompt": prompt, "tests": ADD_TESTS, "pairs": pair} for pair in PAIRS]
    trainer = GRPOTrainer(
        model=example.tiny_model(tokenizer),
        processing_class=tokenizer,
        reward_funcs=[sync, asyn],
        args=example.tiny_config(str(tmp_path / "out"), len(PAIRS)),
        train_dataset=Dataset.from_list(rows),
        environment_factory=Env,
    )
    assert trainer.reward_func_names == ["boltz_code", "boltz_async", "BoltzCodeEnvironment"]
    trainer.train()

    assert trainer.state.global_step == len(PAIRS)
    # Groups whose two programs score differently have non-zero advantages: the rewards move the weights.
    assert any(h.get("grad_norm", 0) > 0 for h in trainer.state.log_history)
    expected = {"good": 1.0, "wrong": 0.0, "loop": 0.0, "hostile": 0.0}
    for reward in (sync, asyn):
        assert sorted(n for n, _ in reward.graded) == sorted(n for p in PAIRS for n in p), "each program once"
        assert all(score == expected[name] for name, score in reward.graded), reward.graded
        # The loop is killed on run_timeout (1 s): no call waits for it longer than a few timeouts.
        assert max(reward.durations) < 15.0, reward.durations
    logged = [h for h in trainer.state.log_history if "rewards/BoltzCodeEnvironment/mean" in h]
    assert len(logged) == len(PAIRS)
    # get_reward graded each rollout's last run_code program: over the epoch, 3 good of 8 -> mean 0.375.
    env_means = [h["rewards/BoltzCodeEnvironment/mean"] for h in logged]
    assert sum(env_means) / len(env_means) == pytest.approx(3 / 8)
    loops = [out for name, out in sync.tool_outputs if name == "loop"]
    assert len(loops) == 2 and all("TimeLimitExceeded" in out for out in loops), "the tool's loop is killed too"
    hostile_outputs = [out for name, out in sync.tool_outputs if name == "hostile"]
    assert len(hostile_outputs) == 2 and all("STOLEN  []" in out for out in hostile_outputs), hostile_outputs
    assert SECRET not in "".join(out for _, out in sync.tool_outputs)
    assert secret.read_text() == SECRET

    # The trainer's environments give their pool envs back when dropped.
    assert rollout_leases.leased == 2
    del trainer, Env
    gc.collect()
    assert rollout_leases.leased == 0
