"""The env side of sandboxes of several envs, run as real processes over real pipes.

Each test starts an env process the way the worker does (a factory env directory, or an
``env.py`` calling ``serve()``) with ``BOLTZLABS_ENVS_PER_SANDBOX``/``BOLTZLABS_ENV_COUNT`` in
its environment, writes sandbox request lines to its stdin and reads sandbox replies, every read
under a deadline. The wire is "Sandboxes of several envs" in :mod:`boltzlabs_gym.wire.protocol`.
"""

from __future__ import annotations

import functools
import json
import os
import select
import struct
import subprocess
import sys
import textwrap
import time

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces as gs

from boltzlabs_gym.wire.info_layout import InfoLayout
from boltzlabs_gym.envside import sandbox_slots
from boltzlabs_gym.wire import protocol
from boltzlabs_gym.wire.codec import decode, decode_info
from boltzlabs_gym.vector.factory_env_dir import write_factory_env_dir
from boltzlabs_gym.wire.protocol import env_request
from boltzlabs_gym.wire.spaces import space_from_json

pytestmark = pytest.mark.timeout(120)

# The test envs below live in this (non-importable) test module: pickle them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SERVE_FACTORIES = [sys.executable, "-c", "from boltzlabs_gym.envside.gym_start import serve_factories; serve_factories()"]
READ_TIMEOUT_S = 20.0


# ----------------------------------------------------------------------------------- test envs


class RaisesOnStep(gym.Wrapper):
    """Raises in ``step`` on its ``on``-th step since start."""

    def __init__(self, env, on):
        super().__init__(env)
        self.on, self.t = on, 0

    def step(self, action):
        self.t += 1
        if self.t == self.on:
            raise RuntimeError("boom on purpose")
        return self.env.step(action)


class InfoOnEvenSteps(gym.Wrapper):
    """Adds ``info["t"]`` on even steps (odd steps keep the env's empty info); ``as_text``: as a string."""

    def __init__(self, env, as_text=False):
        super().__init__(env)
        self.t = 0
        self.as_text = as_text

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.t += 1
        if self.t % 2 == 0:
            info = dict(info, t=str(self.t) if self.as_text else self.t)
        return obs, reward, terminated, truncated, info


class Sleepy(gym.Wrapper):
    """Sleeps before each step: a slot that holds its sandbox up."""

    def step(self, action):
        time.sleep(1.5)
        return self.env.step(action)


class Tagged(gym.Wrapper):
    """Carries the factory's tag, readable with get_attr."""

    def __init__(self, env, tag):
        super().__init__(env)
        self.tag = tag


class DictObsEnv(gym.Env):
    """Dict observations: no sandbox row can hold them."""

    observation_space = gs.Dict({"pos": gs.Box(-1, 1, (2,), np.float32), "k": gs.Discrete(5)})
    action_space = gs.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def _obs(self):
        return {"pos": self.np_random.uniform(-1, 1, 2).astype(np.float32), "k": self.t % 5}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action), self.t >= 3, False, {}


make_cartpole = functools.partial(gym.make, "CartPole-v1")
make_pendulum = functools.partial(gym.make, "Pendulum-v1")


def make_raising():
    return RaisesOnStep(gym.make("CartPole-v1"), on=3)


def make_info_cartpole():
    return InfoOnEvenSteps(gym.make("CartPole-v1"))


def make_text_info_cartpole():
    return InfoOnEvenSteps(gym.make("CartPole-v1"), as_text=True)


def make_sleepy():
    return Sleepy(gym.make("CartPole-v1"))


def make_tagged(tag):
    return Tagged(gym.make("CartPole-v1"), tag)


# ----------------------------------------------------------------------------------- the process


class EnvProc:
    """An env process hosting several envs, driven over its pipes with a deadline on every read."""

    def __init__(self, tmp_path, argv, *, k, m=None, index=-1, env_dir=None, cwd=None):
        self.workspace = tmp_path / "workspace"
        self.workspace.mkdir(exist_ok=True)
        self.stderr = open(tmp_path / "stderr.txt", "w+b")  # noqa: SIM115 - closed by stop()
        env = dict(
            os.environ,
            BOLTZLABS_WORKSPACE=str(self.workspace),
            BOLTZLABS_ENV_INDEX=str(index),
        )
        env.pop("BOLTZLABS_ENV_COUNT", None)
        env.pop("BOLTZLABS_ENVS_PER_SANDBOX", None)
        if k is not None:
            env["BOLTZLABS_ENVS_PER_SANDBOX"] = str(k)
        if m is not None:
            env["BOLTZLABS_ENV_COUNT"] = str(m)
        if env_dir is not None:
            env["BOLTZLABS_ENV_DIR"] = str(env_dir)
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr
        )
        self.buf = bytearray()

    @classmethod
    def gym(cls, tmp_path, factories, **kw):
        env_dir = write_factory_env_dir(tmp_path / "envdir", factories)
        return cls(tmp_path, SERVE_FACTORIES, env_dir=env_dir, **kw)

    def send(self, msg, payloads=()):
        self.send_raw(env_request(msg, payloads))

    def send_raw(self, data):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _fill(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
            raise TimeoutError(f"no reply in time; stderr:\n{self.stderr_text()}")
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not data:
            raise EOFError(f"the env process closed its stdout; stderr:\n{self.stderr_text()}")
        self.buf += data

    def read_reply(self, timeout=READ_TIMEOUT_S):
        """One reply: ``(message, payloads, raw line)``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            self._fill(deadline)
        end = self.buf.index(b"\n") + 1
        line = bytes(self.buf[:end])
        del self.buf[:end]
        msg = json.loads(line)
        payloads = []
        for n in msg.get("_bin", []):
            while len(self.buf) < n:
                self._fill(deadline)
            payloads.append(bytes(self.buf[:n]))
            del self.buf[:n]
        return msg, payloads, line

    def call(self, msg, payloads=()):
        self.send(msg, payloads)
        return self.read_reply()[:2]

    def progress(self):
        with open(self.workspace / protocol.PROGRESS_FILE, "rb") as f:
            return struct.unpack("<i", f.read())[0]

    def stderr_text(self):
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def wait(self, timeout=READ_TIMEOUT_S):
        return self.proc.wait(timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()


@pytest.fixture
def procs():
    started = []
    yield started
    for proc in started:
        proc.stop()


def sandbox_request(slots, ops, **extra):
    return {"op": protocol.sandbox_op_name(ops), "slots": slots, "ops": ops, **extra}


def all_slots(ops, **extra):
    return sandbox_request(list(range(len(ops))), ops, **extra)


def positions(reply, payloads, obs_space=None):
    """Each position's transition as a one-env reply would give it (decoded), checking the layout."""
    assert reply.get("_bin", []) == [len(x) for x in payloads]
    n = reply["n"]
    arrays = [reply[protocol.SANDBOX_OBS], reply[protocol.SANDBOX_REWARD], reply[protocol.SANDBOX_FLAGS]]
    assert arrays == [None] * 3 or None not in arrays
    out: list = [None] * n
    k = 0
    if arrays[0] is not None:
        obs, reward, flags = (decode_info(a, payloads) for a in arrays)
        assert obs.shape[0] == reward.shape[0] == flags.shape[0] == n
        assert reward.dtype == np.float64 and flags.dtype == np.uint8
        k = 3
        info_rows = None
        if protocol.SANDBOX_INFO in reply:
            layout = InfoLayout.read(reply[protocol.SANDBOX_INFO], n, k)
            info_rows = layout.rows(payloads[k : k + len(layout.sizes)])
            k += len(layout.sizes)
        for p in range(n):
            out[p] = {
                "plain": True,
                "obs": obs[p],
                "reward": float(reward[p]),
                "terminated": bool(flags[p] & protocol.FLAG_TERMINATED),
                "truncated": bool(flags[p] & protocol.FLAG_TRUNCATED),
                "info": info_rows.info_of(p) if info_rows is not None else {},
            }
    keys = sorted(int(p) for p in reply[protocol.SANDBOX_REPLIES])
    assert [str(p) for p in keys] == list(reply[protocol.SANDBOX_REPLIES])  # in position order
    for p in keys:
        one = reply[protocol.SANDBOX_REPLIES][str(p)]
        own = payloads[k : k + len(one.get("_bin", []))]
        k += len(own)
        assert one.get("_bin", []) == [len(x) for x in own]
        one = dict(one, plain=False)
        for key in ("obs", "reset_obs"):
            if obs_space is not None and one.get(key) is not None:
                one[key] = decode(obs_space, one[key], own)
        for key in ("info", "reset_info", "value"):
            if key in one:
                one[key] = decode_info(one[key], own)
        out[p] = one
    assert k == len(payloads) and None not in out
    return out


# ----------------------------------------------------------------------------------- the wire constants


def test_env_side_constants_are_the_protocols():
    assert sandbox_slots.PROGRESS_FILE == protocol.PROGRESS_FILE
    assert sandbox_slots.MAX_ENVS_PER_SANDBOX == protocol.MAX_ENVS_PER_SANDBOX
    assert sandbox_slots._SANDBOX_KEYS == (
        protocol.SANDBOX_SLOTS,
        protocol.SANDBOX_OPS,
        protocol.SANDBOX_NBIN,
        protocol.SANDBOX_AUTORESET,
    )


def test_sandbox_ops_expands_shorthands_and_splits_payloads():
    msg = {"slots": [2, 0], "ops": [1, {"op": "step", "action": {}}], "autoreset": True, "nbin": [0, 2]}
    got = sandbox_slots.sandbox_ops(msg, [b"a", b"bc"], 3)
    assert got == [
        (2, {"op": "step", "action": 1, "autoreset": True}, []),
        (0, {"op": "step", "action": {}}, [b"a", b"bc"]),
    ]
    for bad, payloads in [
        ({"slots": [0, 0], "ops": [1, 1]}, []),
        ({"slots": [3], "ops": [1]}, []),
        ({"slots": [True], "ops": [1]}, []),
        ({"slots": [0], "ops": [1, 2]}, []),
        ({"slots": [0], "ops": ["step"]}, []),
        ({"slots": [0], "ops": [1]}, [b"x"]),
        ({"slots": [0], "ops": [1], "nbin": [2]}, [b"x"]),
        ({"slots": [0], "ops": [1], "autoreset": 1}, []),
        ({"op": "step", "action": 1}, []),
    ]:
        with pytest.raises(sandbox_slots.ProtocolError):
            sandbox_slots.sandbox_ops(bad, payloads, 3)


def test_sandbox_config_reads_and_checks_the_environment(capsys):
    assert sandbox_slots.sandbox_config({}) == (1, 1)
    assert sandbox_slots.sandbox_config({"BOLTZLABS_ENVS_PER_SANDBOX": "8"}) == (8, 8)
    assert sandbox_slots.sandbox_config({"BOLTZLABS_ENVS_PER_SANDBOX": "8", "BOLTZLABS_ENV_COUNT": "3"}) == (8, 3)
    for bad in [{"BOLTZLABS_ENVS_PER_SANDBOX": "0"}, {"BOLTZLABS_ENVS_PER_SANDBOX": "x"},
                {"BOLTZLABS_ENVS_PER_SANDBOX": "2", "BOLTZLABS_ENV_COUNT": "3"},
                {"BOLTZLABS_ENVS_PER_SANDBOX": "5000"}]:  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            sandbox_slots.sandbox_config(bad)
        assert exc.value.code == 2
        assert "is not an integer in" in capsys.readouterr().err


def test_progress_tolerates_a_workspace_it_cannot_write(tmp_path, capsys):
    progress = sandbox_slots.Progress(str(tmp_path / "missing"))
    progress.set(3)
    progress.idle()
    assert "serving without it" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- CartPole, three slots


def _local_cartpoles(n):
    return [gym.make("CartPole-v1") for _ in range(n)]


def test_cartpole_sandbox_matches_separate_envs(tmp_path, procs):
    proc = EnvProc.gym(tmp_path, [make_cartpole], k=3, m=3)
    procs.append(proc)
    reply, payloads = proc.call(all_slots([{"op": "describe"}] * 3))
    described = positions(reply, payloads)
    assert reply["obs"] is None and all(d["spec_id"] == "CartPole-v1" for d in described)
    obs_space = space_from_json(described[0]["observation_space"])

    seeds = [11, 12, 13]
    local = _local_cartpoles(3)
    reply, payloads = proc.call(all_slots([{"op": "reset", "seed": s} for s in seeds]))
    assert reply["replies"] == {}
    for got, env, seed in zip(positions(reply, payloads), local, seeds):
        assert got["plain"] and np.array_equal(got["obs"], env.reset(seed=seed)[0])
        assert got["obs"].dtype == np.float32

    rng = np.random.default_rng(0)
    ended = [False] * 3
    seen = {"plain": 0, "autoreset": 0, "reset_op": 0, "subset": 0}
    for t in range(600):
        same_step = t >= 300
        slots = [2, 0] if t % 7 == 3 else [0, 1, 2]
        seen["subset"] += len(slots) == 2
        ops, expected = [], []
        for s in slots:
            if ended[s] and not same_step:
                ops.append({"op": "reset", "seed": None})  # NEXT_STEP: the ended env resets first
                expected.append(("reset", local[s].reset()[0]))
                ended[s] = False
                continue
            a = int(rng.integers(2))
            ops.append(a)
            obs, reward, terminated, truncated, _ = local[s].step(a)
            ended[s] = terminated or truncated
            reset_obs = None
            if same_step and ended[s]:
                reset_obs, _ = local[s].reset()
                ended[s] = False
            expected.append(("step", obs, reward, terminated, truncated, reset_obs))
        reply, payloads = proc.call(sandbox_request(slots, ops, **({"autoreset": True} if same_step else {})))
        for got, want in zip(positions(reply, payloads, obs_space), expected):
            if want[0] == "reset":
                seen["reset_op"] += 1
                assert got["plain"] and np.array_equal(got["obs"], want[1]) and got["reward"] == 0.0
                assert not got["terminated"] and not got["truncated"]
                continue
            _, obs, reward, terminated, truncated, reset_obs = want
            assert np.array_equal(got["obs"], obs)
            assert (got["reward"], got["terminated"], got["truncated"]) == (reward, terminated, truncated)
            assert got["info"] == {}
            if reset_obs is not None:  # SAME_STEP: the reset rides in the reply, so the position is not plain
                seen["autoreset"] += 1
                assert not got["plain"] and np.array_equal(got["reset_obs"], reset_obs) and got["reset_info"] == {}
            else:
                seen["plain"] += 1
                assert got["plain"]
    assert proc.progress() == -1
    assert all(seen.values()), seen

    proc.send(all_slots([{"op": "close"}] * 3))
    reply, payloads, _ = proc.read_reply()
    assert reply == {"n": 3, "obs": None, "reward": None, "flags": None, "replies": {"0": {}, "1": {}, "2": {}}}
    assert proc.wait() == 0


def test_example_sandbox_reply_layout(tmp_path, procs):
    proc = EnvProc.gym(tmp_path, [make_cartpole], k=3)
    procs.append(proc)
    proc.call(all_slots([{"op": "reset", "seed": 1}] * 3))
    proc.send(all_slots([1, 0, 1]))
    reply, payloads, line = proc.read_reply()
    assert line == (
        b'{"n":3,"obs":{"__nd__":[0,"<f4",[3,4]]},"reward":{"__nd__":[1,"<f8",[3]]},'
        b'"flags":{"__nd__":[2,"|u1",[3]]},"replies":{},"_bin":[48,24,3]}\n'
    )
    assert [len(x) for x in payloads] == [48, 24, 3]


def test_step_that_raises_answers_for_its_slot_only(tmp_path, procs):
    # index 1: slot 0 is factories[1] (raising), slot 1 factories[0], slot 2 factories[1]
    proc = EnvProc.gym(tmp_path, [make_cartpole, make_raising], k=3, index=1)
    procs.append(proc)
    proc.call(all_slots([{"op": "reset", "seed": 5}] * 3))
    for t in range(1, 4):
        reply, payloads = proc.call(all_slots([0, 0, 0]))
        got = positions(reply, payloads)
        if t < 3:
            assert all(g["plain"] for g in got)
            continue
        assert sorted(reply["replies"]) == ["0", "2"] and got[1]["plain"]
        for p in (0, 2):
            assert got[p]["obs"] is None and got[p]["terminated"] and got[p]["reward"] == 0.0
            assert "boom on purpose" in got[p]["info"]["boltzlabs_exception"]["traceback"]
            assert got[p]["info"]["boltzlabs_exception"]["where"] == "step"
    # the plain position's row carries no leftovers of the others'
    rows = decode_info(reply["obs"], payloads)
    assert not rows[0].any() and not rows[2].any() and rows[1].any()


def test_factory_of_each_slot_follows_the_first_slots_index(tmp_path, procs):
    factories = [functools.partial(make_tagged, tag) for tag in "abc"]
    proc = EnvProc.gym(tmp_path, factories, k=4, m=4, index=5)
    procs.append(proc)
    reply, payloads = proc.call(all_slots([{"op": "get_attr", "name": "tag"}] * 4))
    assert [g["value"] for g in positions(reply, payloads)] == ["c", "a", "b", "c"]


@pytest.mark.parametrize(
    "factory, columns", [(make_info_cartpole, True), (make_text_info_cartpole, False)], ids=["number", "text"]
)
def test_number_infos_are_rows_and_others_go_to_replies(tmp_path, procs, factory, columns):
    """An info of numbers is the position's row of the info columns (the position stays plain, an
    absent key's presence byte 0); an info with a string in it is the position's own reply."""
    proc = EnvProc.gym(tmp_path, [factory], k=2)
    procs.append(proc)
    local = [factory() for _ in range(2)]
    proc.call(all_slots([{"op": "reset", "seed": s} for s in (1, 2)]))
    for env, s in zip(local, (1, 2)):
        env.reset(seed=s)
    for t in range(1, 5):
        reply, payloads = proc.call(all_slots([1, 1]))
        got = positions(reply, payloads, gs.Box(-np.inf, np.inf, (4,), np.float32))
        assert (protocol.SANDBOX_INFO in reply) == (columns and t >= 2)
        for g, env in zip(got, local):
            obs, reward, *_, info = env.step(1)
            assert np.array_equal(g["obs"], obs) and g["reward"] == reward
            assert g["plain"] == (columns or t % 2 == 1) and g["info"] == info
            assert [type(v) for v in g["info"].values()] == [type(v) for v in info.values()]


def test_box_actions_travel_as_one_batch(tmp_path, procs):
    """``"actions"``: one payload of rows, a ``None`` op steps with its row, in the batch's dtype;
    rows that are not the env's actions fail those positions' steps, and the process serves on."""
    proc = EnvProc.gym(tmp_path, [make_pendulum], k=2)
    procs.append(proc)
    local = [make_pendulum() for _ in range(2)]
    proc.call(all_slots([{"op": "reset", "seed": s} for s in (3, 4)]))
    for env, s in zip(local, (3, 4)):
        env.reset(seed=s)
    rng = np.random.default_rng(1)
    for _ in range(10):
        actions = rng.uniform(-2, 2, (2, 1)).astype(np.float32)
        batch = {"__nd__": [0, "<f4", [2, 1]]}
        reply, payloads = proc.call(all_slots([None, None], actions=batch), [actions.tobytes()])
        assert reply["replies"] == {}
        for g, env, a in zip(positions(reply, payloads), local, actions):
            obs, reward, *_ = env.step(a)
            assert np.array_equal(g["obs"], obs) and g["reward"] == reward
    wrong = np.zeros((2, 3), np.float32)
    reply, payloads = proc.call(all_slots([None, None], actions={"__nd__": [0, "<f4", [2, 3]]}), [wrong.tobytes()])
    for g in positions(reply, payloads):
        failure = g["info"]["boltzlabs_exception"]
        assert failure["where"] == "action" and "is not an action of" in failure["traceback"]
    short = {"__nd__": [0, "<f4", [2, 1]]}
    reply, payloads = proc.call(all_slots([None, None], actions=short), [b"\0" * 4])  # rows, but not <f4's
    for g in positions(reply, payloads):
        assert "is not [2, 1] of float32" in g["info"]["boltzlabs_exception"]["traceback"]
    reply, _ = proc.call(all_slots([None, None], actions=short), [b"\0" * 5])  # not whole rows: the wire's
    assert "actions of 5 bytes are not 2 rows" in reply["error"]
    reply, payloads = proc.call(all_slots([None, None], actions=batch), [actions.tobytes()])
    assert reply["replies"] == {}


def test_box_actions_travel_as_payloads(tmp_path, procs):
    proc = EnvProc.gym(tmp_path, [make_pendulum], k=2)
    procs.append(proc)
    local = [make_pendulum() for _ in range(2)]
    proc.call(all_slots([{"op": "reset", "seed": s} for s in (3, 4)]))
    for env, s in zip(local, (3, 4)):
        env.reset(seed=s)
    rng = np.random.default_rng(1)
    for _ in range(20):
        actions = rng.uniform(-2, 2, (2, 1)).astype(np.float32)
        op = {"op": "step", "action": {"__nd__": [0, "<f4", [1]]}}
        reply, payloads = proc.call(all_slots([op, op], nbin=[1, 1]), [a.tobytes() for a in actions])
        assert reply["replies"] == {}
        for g, env, a in zip(positions(reply, payloads), local, actions):
            obs, reward, *_ = env.step(a)
            assert np.array_equal(g["obs"], obs) and g["reward"] == float(reward)
    # an action of the wrong shape is that position's error transition, the other is served
    bad = {"op": "step", "action": {"__nd__": [0, "<f4", [2]]}}
    reply, payloads = proc.call(all_slots([bad, op], nbin=[1, 1]), [bytes(8), bytes(4)])
    got = positions(reply, payloads)
    assert got[0]["info"]["boltzlabs_exception"]["where"] == "action" and got[1]["plain"]


def test_dict_observations_all_go_to_replies(tmp_path, procs):
    proc = EnvProc.gym(tmp_path, [DictObsEnv], k=2)
    procs.append(proc)
    reply, payloads = proc.call(all_slots([{"op": "describe"}] * 2))
    obs_space = space_from_json(positions(reply, payloads)[0]["observation_space"])
    reply, payloads = proc.call(all_slots([{"op": "reset", "seed": 1}, {"op": "reset", "seed": 2}]))
    assert reply["obs"] is None and reply["reward"] is None and reply["flags"] is None
    local = [DictObsEnv(), DictObsEnv()]
    for g, env, s in zip(positions(reply, payloads, obs_space), local, (1, 2)):
        want, _ = env.reset(seed=s)
        assert np.array_equal(g["obs"]["pos"], want["pos"]) and g["obs"]["k"] == want["k"]
    for _ in range(4):
        reply, payloads = proc.call(all_slots([1, 0], autoreset=True))
        assert set(reply["replies"]) == {"0", "1"}
        for g, env, a in zip(positions(reply, payloads, obs_space), local, (1, 0)):
            obs, reward, terminated, truncated, _ = env.step(a)
            assert np.array_equal(g["obs"]["pos"], obs["pos"]) and g["reward"] == reward
            assert g["terminated"] == terminated
            if terminated:
                assert np.array_equal(g["reset_obs"]["pos"], env.reset()[0]["pos"])


def test_bad_requests_are_answered_and_the_process_serves_on(tmp_path, procs):
    proc = EnvProc.gym(tmp_path, [make_cartpole], k=3, m=2)
    procs.append(proc)
    for bad in [
        {"op": "step", "action": 1},  # not a sandbox request
        sandbox_request([0, 0], [1, 1]),
        sandbox_request([2], [1]),  # m = 2: slot 2 is not hosted
        sandbox_request([0, 1], [1]),
        sandbox_request([0], [1], nbin=[1]),
    ]:
        reply, payloads = proc.call(bad)
        assert set(reply) == {"error"} and not payloads
    proc.send_raw(b"not json\n")
    assert set(proc.read_reply()[0]) == {"error"}
    reply, payloads = proc.call(sandbox_request([1, 0], [{"op": "reset", "seed": 1}, {"op": "frobnicate"}]))
    got = positions(reply, payloads)
    assert got[0]["plain"] and got[1]["error"] == "unknown op 'frobnicate'"
    reply, payloads = proc.call(sandbox_request([1], [7]))  # out of Discrete(2)'s range
    assert positions(reply, payloads)[0]["info"]["boltzlabs_exception"]["where"] == "action"


def test_progress_names_the_slot_being_served(tmp_path, procs):
    proc = EnvProc.gym(tmp_path, [make_cartpole, make_sleepy], k=3)  # slot 1 sleeps in step
    procs.append(proc)
    proc.call(all_slots([{"op": "reset", "seed": 0}] * 3))
    assert proc.progress() == -1
    proc.send(all_slots([0, 0, 0]))
    deadline = time.monotonic() + 10
    while proc.progress() != 1:
        assert time.monotonic() < deadline, "the progress file never named the sleeping slot"
        time.sleep(0.01)
    reply, payloads, _ = proc.read_reply()
    assert reply["n"] == 3 and reply["replies"] == {}
    assert proc.progress() == -1


# A boltz template's fork loop, stood in for: the "fork" hands the env the worker's environment
# (as envside/forkserver.py does), which alone says how many envs to host.
BOLTZ_STAND_IN = (
    "import os\n"
    "from boltzlabs_gym.envside import process_setup as process\n"
    "assert process.in_template() and 'BOLTZLABS_ENVS_PER_SANDBOX' not in os.environ\n"
    "def fork():\n"
    "    os.environ.update(BOLTZLABS_ENVS_PER_SANDBOX='3', BOLTZLABS_ENV_COUNT='2', BOLTZLABS_ENV_INDEX='1')\n"
    "process.install_template_hook(fork)\n"
    "from boltzlabs_gym.envside.gym_start import serve_factories\n"
    "serve_factories()\n"
)


def test_boltz_fork_reads_its_envs_after_the_fork(tmp_path, procs, monkeypatch):
    monkeypatch.setenv("BOLTZLABS_TEMPLATE", "process")
    monkeypatch.delenv("BOLTZLABS_ENVS_PER_SANDBOX", raising=False)
    env_dir = write_factory_env_dir(tmp_path / "envdir", [functools.partial(make_tagged, t) for t in "ab"])
    proc = EnvProc(tmp_path, [sys.executable, "-c", BOLTZ_STAND_IN], k=None, env_dir=env_dir)
    procs.append(proc)
    reply, payloads = proc.call(all_slots([{"op": "get_attr", "name": "tag"}] * 2))
    assert [g["value"] for g in positions(reply, payloads)] == ["b", "a"]
    assert set(proc.call(sandbox_request([2], [1]))[0]) == {"error"}  # two envs hosted, not three


def test_end_of_input_closes_and_exits(tmp_path, procs):
    proc = EnvProc.gym(tmp_path, [make_cartpole], k=2)
    procs.append(proc)
    proc.call(all_slots([{"op": "reset", "seed": 0}] * 2))
    proc.proc.stdin.close()
    assert proc.wait() == 0


# ----------------------------------------------------------------------------------- env.py serve()

COUNTER_LOGIC = """
    def reset(self, seed, options=None):
        self.t = 0 if seed is None else seed
        return {"t": self.t}
    def step(self, action):
        self.t += 1
        if action == "raise":
            raise ValueError("asked to")
        return {"t": self.t}, float(action) / 2, self.t >= 3, {"even": self.t % 2 == 0}
"""
FUNCTION_FORM = (
    "from boltzlabs_gym.env import serve\n"
    "class _S:\n    t = 0\n" + textwrap.indent(textwrap.dedent(COUNTER_LOGIC), "    ") + "_s = _S()\n"
    "serve(reset=_s.reset, step=_s.step, observation_space={'type': 'Discrete', 'n': 2})\n"
)
FACTORY_FORM = (
    "from boltzlabs_gym.env import serve\n"
    "class Counter:\n    t = 0\n" + textwrap.indent(textwrap.dedent(COUNTER_LOGIC), "    ") + ""
    "serve(factory=Counter, observation_space={'type': 'Discrete', 'n': 2})\n"
)


def _env_py(tmp_path, source):
    d = tmp_path / "env"  # one path for every form: tracebacks in replies name it
    d.mkdir(exist_ok=True)
    (d / "env.py").write_text(source)
    return d


def _run_env_py(tmp_path, source, k, requests: bytes, m=None):
    d = _env_py(tmp_path, source)
    env = dict(os.environ, BOLTZLABS_WORKSPACE=str(d), BOLTZLABS_ENVS_PER_SANDBOX=str(k))
    env.pop("BOLTZLABS_ENV_COUNT", None)
    if m is not None:
        env["BOLTZLABS_ENV_COUNT"] = str(m)
    return subprocess.run(
        [sys.executable, "env.py"], cwd=d, env=env, input=requests, capture_output=True, timeout=READ_TIMEOUT_S
    )


ONE_ENV_REQUESTS = b"".join(
    env_request(op)
    for op in [
        {"op": "describe"},
        {"op": "reset", "seed": 4},
        {"op": "step", "action": 1},
        {"op": "step", "action": "raise"},
        {"op": "reset", "seed": None},
        {"op": "step", "action": 0, "autoreset": True},
        {"op": "step", "action": 1, "autoreset": True},
        {"op": "step", "action": 1, "autoreset": True},
        {"op": "nope"},
        {"op": "close"},
    ]
)


def test_factory_form_with_one_env_writes_what_the_function_form_writes(tmp_path):
    function = _run_env_py(tmp_path, FUNCTION_FORM, 1, ONE_ENV_REQUESTS)
    factory = _run_env_py(tmp_path, FACTORY_FORM, 1, ONE_ENV_REQUESTS)
    assert function.returncode == factory.returncode == 0, function.stderr + factory.stderr
    assert function.stdout.count(b"\n") == 10
    assert factory.stdout == function.stdout
    assert not (tmp_path / "env" / protocol.PROGRESS_FILE).exists()  # one env: no sandbox machinery


def test_factory_form_with_two_envs_answers_sandbox_requests(tmp_path):
    requests = b"".join(
        env_request(msg)
        for msg in [
            all_slots([{"op": "describe"}] * 2),
            all_slots([{"op": "reset", "seed": 0}, {"op": "reset", "seed": 10}]),
            sandbox_request([1, 0], [1, 1], autoreset=True),
            sandbox_request([1], [{"op": "step", "action": "raise"}]),
            sandbox_request([0, 1], [1, {"op": "nope"}]),
            sandbox_request([0, 0], [1, 1]),  # bad: answered, and serving goes on
            sandbox_request([0], [1], autoreset=True),  # slot 0 reaches t = 3: SAME_STEP autoreset
            all_slots([{"op": "close"}] * 2),
        ]
    )
    done = _run_env_py(tmp_path, FACTORY_FORM, 2, requests)
    assert done.returncode == 0, done.stderr
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(replies) == 8
    for r in replies[:5] + replies[6:]:
        assert set(r) == {"n", "obs", "reward", "flags", "replies"} and r["obs"] is None  # no "_bin"
        assert list(r["replies"]) == [str(p) for p in range(r["n"])]  # every position
    assert replies[0]["replies"]["0"] == {"observation_space": {"type": "Discrete", "n": 2}, "action_space": None,
                                          "metadata": {}}  # fmt: skip
    assert [r["obs"] for r in replies[1]["replies"].values()] == [{"t": 0}, {"t": 10}]
    assert replies[2]["replies"]["0"]["obs"] == {"t": 11} and replies[2]["replies"]["0"]["terminated"]
    assert replies[2]["replies"]["0"]["reset_obs"] == {"t": 0}  # seed None: t = 0
    assert replies[2]["replies"]["1"] == {"obs": {"t": 1}, "reward": 0.5, "terminated": False, "truncated": False,
                                          "info": {"even": False}}  # fmt: skip
    assert "boltzlabs_exception" in replies[3]["replies"]["0"]["info"]
    assert replies[4]["replies"]["0"]["obs"] == {"t": 2} and replies[4]["replies"]["1"] == {
        "error": "unknown op 'nope'"
    }
    assert set(replies[5]) == {"error"}
    assert replies[6]["replies"]["0"]["terminated"] and replies[6]["replies"]["0"]["reset_obs"] == {"t": 0}
    assert replies[7]["replies"] == {"0": {}, "1": {}}
    progress = (tmp_path / "env" / protocol.PROGRESS_FILE).read_bytes()
    assert struct.unpack("<i", progress)[0] == -1


def test_function_form_refuses_several_envs(tmp_path):
    done = _run_env_py(tmp_path, FUNCTION_FORM, 2, b"")
    assert done.returncode == 2
    assert b"envs_per_sandbox=2 needs independent env instances" in done.stderr
    assert b"serve(factory=make_env)" in done.stderr


@pytest.mark.parametrize(
    "call, message",
    [
        ("serve()", "needs factory=make_env, or both reset= and step="),
        ("serve(reset=lambda s: 0)", "needs factory=make_env, or both reset= and step="),
        ("serve(lambda s: 0, lambda a: 0, factory=object)", "not both"),
        ("serve(factory=3)", "must be a callable"),
    ],
)
def test_serve_takes_one_form(call, message):
    with pytest.raises(TypeError, match=message):
        exec(f"from boltzlabs_gym.env import serve\n{call}")
