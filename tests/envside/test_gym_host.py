"""The Gymnasium env host, run as a real subprocess from a factory env directory."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces as gs

from boltzlabs_gym.wire.codec import decode, decode_info, encode, encode_info, to_json_safe
from boltzlabs_gym.env import read_message, write_message
from boltzlabs_gym.vector.factory_env_dir import ENV_PY, FACTORIES_FILE, write_factory_env_dir
from boltzlabs_gym.wire.spaces import space_from_json

pytestmark = pytest.mark.timeout(60)

# The test envs below live in this (non-importable) test module: pickle them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DictTupleEnv(gym.Env):
    """Dict/Tuple observations, a Tuple action, numpy infos, rgb frames, and failure switches."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 7}

    def __init__(self, render_mode=None):
        print("hello from __init__: must not reach the protocol channel")
        self.observation_space = gs.Dict(
            [
                ("pos", gs.Box(-np.inf, np.inf, (3,), np.float32)),
                ("grid", gs.Box(0, 255, (4, 4), np.uint8)),
                ("mode", gs.Discrete(3)),
                ("pair", gs.Tuple([gs.MultiBinary(4), gs.MultiDiscrete([3, 5])])),
                ("name", gs.Text(2, charset="ab")),
            ]
        )
        self.action_space = gs.Tuple([gs.Discrete(3), gs.Box(-1, 1, (2,), np.float32)])
        self.render_mode = render_mode
        self.explode = False
        self.bad_obs = False
        self.counter = 0
        self.t = 0

    def _obs(self):
        rng = self.np_random
        return {
            "pos": rng.standard_normal(3).astype(np.float32),
            "grid": rng.integers(0, 256, (4, 4), dtype=np.uint8),
            "mode": np.int64(self.t % 3),
            "pair": (rng.integers(0, 2, 4).astype(np.int8), np.array([self.t % 3, self.t % 5])),
            "name": "ab"[: 1 + self.t % 2],
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if options and options.get("boom"):
            raise RuntimeError("reset boom")
        self.t = 0
        return self._obs(), {"start": np.float32(0.5), "options": options}

    def step(self, action):
        print("stepping", action)
        if self.explode:
            raise ValueError("kaboom")
        kind, vec = action
        self.t += 1
        self.counter += 1
        obs = self._obs()
        if self.bad_obs:
            obs["pos"] = np.zeros(7)
        reward = float(kind) + float(vec.sum())
        info = {"t": np.int32(self.t), "vec": vec * 2, "nested": {"k": (1, 2)}}
        return obs, reward, self.t >= 4, False, info

    def render(self):
        frame = np.zeros((6, 8, 3), np.uint8)
        frame[..., 0] = self.t
        return frame

    def scale(self, x, factor=2):
        return np.asarray(x) * factor


class NoJsonSpace(gs.Space):
    """A space of the user's own: it has no JSON form."""


class BufferEnv(gym.Env):
    """Reuses one observation buffer in place; its action space has no JSON form (a custom space)."""

    observation_space = gs.Box(-10, 10, (3,), np.float32)
    action_space = NoJsonSpace()

    def __init__(self):
        self.buf = np.zeros(3, np.float32)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.buf[:] = -1.0
        return self.buf, {}

    def step(self, action):
        self.t += 1
        self.buf[:] = self.t
        return self.buf, float(sum(action)), self.t >= 2, False, {"action": action}


def make_dict_env():
    return gym.wrappers.RecordEpisodeStatistics(DictTupleEnv(render_mode="rgb_array"))


make_cartpole = functools.partial(gym.make, "CartPole-v1")


class Server:
    """A Gymnasium env host subprocess started from a factory env dir, as the worker starts it."""

    def __init__(self, tmp_path, factories, index):
        self.dir = write_factory_env_dir(tmp_path / "envdir", factories)
        self.stderr = open(tmp_path / "stderr.txt", "w+b")
        env = dict(os.environ, BOLTZLABS_ENV_DIR=str(self.dir), BOLTZLABS_ENV_INDEX=str(index),
                   BOLTZLABS_WORKSPACE=str(tmp_path))
        self.proc = subprocess.Popen([sys.executable, "env.py"], cwd=self.dir, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
        desc = self.rpc({"op": "describe"})[0]
        self.desc = desc
        self.obs_space = space_from_json(desc["observation_space"])
        self.action_space = space_from_json(desc["action_space"])

    def rpc(self, msg, payloads=()):
        write_message(self.proc.stdin, msg, payloads)
        got = read_message(self.proc.stdout)
        assert got is not None, self.stderr_text()
        return got

    def raw(self, data: bytes):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()
        return read_message(self.proc.stdout)

    def step(self, action, **extra):
        obj, payloads = encode(self.action_space, action)
        return self.rpc({"op": "step", "action": obj, **extra}, payloads)

    def stderr_text(self):
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("cartpole"), [make_cartpole], -1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dict_env(tmp_path_factory):
    # Two factories; env index 3 picks factories[3 % 2], the Dict/Tuple env.
    server = Server(tmp_path_factory.mktemp("dict"), [make_cartpole, make_dict_env], 3)
    yield server
    server.stop()


def _assert_obs_equal(space, a, b):
    if isinstance(space, gs.Dict):
        assert list(a) == list(b) == list(space.spaces)
        for key, sub in space.spaces.items():
            _assert_obs_equal(sub, a[key], b[key])
    elif isinstance(space, gs.Tuple):
        for sub, x, y in zip(space.spaces, a, b, strict=True):
            _assert_obs_equal(sub, x, y)
    elif isinstance(space, gs.Text):
        assert a == b
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype == space.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def _plain(x):
    """Comparable JSON form of an info; drops the wall-clock episode time."""
    x = to_json_safe(x)
    if isinstance(x, dict) and isinstance(x.get("episode"), dict):
        x["episode"].pop("t", None)
    return x


# --------------------------------------------------------------------------- CartPole


def test_factory_env_dir_files(tmp_path):
    d = write_factory_env_dir(tmp_path / "a", [make_cartpole, make_dict_env])
    assert sorted(os.listdir(d)) == ["env.py", FACTORIES_FILE]
    with open(os.path.join(d, "env.py")) as f:
        assert f.read() == ENV_PY
    d2 = write_factory_env_dir(tmp_path / "b", [make_cartpole, make_dict_env])
    with open(os.path.join(d, FACTORIES_FILE), "rb") as f1, open(os.path.join(d2, FACTORIES_FILE), "rb") as f2:
        assert f1.read() == f2.read()
    with pytest.raises(TypeError):
        write_factory_env_dir(tmp_path / "c", [])


def test_cartpole_describe(cartpole):
    desc = cartpole.desc
    assert desc["server"] == "gym"
    assert desc["spec_id"] == "CartPole-v1" and desc["max_episode_steps"] == 500
    assert desc["render_mode"] is None
    assert desc["metadata"]["render_fps"] == 50
    local = make_cartpole()
    assert cartpole.obs_space == local.observation_space
    assert cartpole.action_space == local.action_space


def test_cartpole_matches_local_env_step_by_step_with_autoreset(cartpole):
    local = make_cartpole()
    reply, payloads = cartpole.rpc({"op": "reset", "seed": 42})
    obs, _ = local.reset(seed=42)
    _assert_obs_equal(cartpole.obs_space, decode(cartpole.obs_space, reply["obs"], payloads), obs)
    assert decode_info(reply["info"], payloads) == {}
    rng = np.random.default_rng(0)
    episodes = 0
    for _ in range(120):
        action = int(rng.integers(2)) if rng.random() < 0.3 else 1
        reply, payloads = cartpole.step(action, autoreset=True)
        obs, reward, terminated, truncated, info = local.step(action)
        _assert_obs_equal(cartpole.obs_space, decode(cartpole.obs_space, reply["obs"], payloads), obs)
        assert (reply["reward"], reply["terminated"], reply["truncated"]) == (reward, terminated, truncated)
        assert decode_info(reply["info"], payloads) == info
        if terminated or truncated:
            episodes += 1
            obs, info = local.reset()  # autoreset: the same RNG stream, no new seed
            _assert_obs_equal(cartpole.obs_space, decode(cartpole.obs_space, reply["reset_obs"], payloads), obs)
            assert decode_info(reply["reset_info"], payloads) == info
        else:
            assert "reset_obs" not in reply and "reset_info" not in reply
    assert episodes >= 2


def test_cartpole_np_random_seed_and_plain_json_action(cartpole):
    cartpole.rpc({"op": "reset", "seed": 7})
    reply, _ = cartpole.rpc({"op": "call", "name": "np_random_seed"})
    assert reply == {"value": 7}
    reply, payloads = cartpole.rpc({"op": "step", "action": 0})  # a plain JSON int action
    assert reply["reward"] == 1.0


def test_torn_stream_answered_then_exit(cartpole):
    # Announces 100 payload bytes, sends 10 and closes: the server answers and exits.
    cartpole.proc.stdin.write(b'{"op":"step","action":1,"_bin":[100]}\n' + bytes(10))
    cartpole.proc.stdin.close()
    got = read_message(cartpole.proc.stdout)
    assert got is not None and "truncated" in got[0]["error"]
    assert cartpole.proc.wait(timeout=10) == 0


def test_reused_obs_buffer_and_space_without_json_form(tmp_path):
    server = Server(tmp_path, [BufferEnv], 0)
    try:
        assert server.desc["action_space"] == {"type": "Json"}
        server.rpc({"op": "reset", "seed": 0})
        reply, payloads = server.rpc({"op": "step", "action": [1, 0, 1], "autoreset": True})
        assert reply["reward"] == 2.0 and decode_info(reply["info"], payloads) == {"action": [1, 0, 1]}
        reply, payloads = server.rpc({"op": "step", "action": [1], "autoreset": True})
        assert reply["terminated"]
        # The reset rewrote the env's buffer; the final obs must not have changed with it.
        np.testing.assert_array_equal(decode(server.obs_space, reply["obs"], payloads), [2, 2, 2])
        np.testing.assert_array_equal(decode(server.obs_space, reply["reset_obs"], payloads), [-1, -1, -1])
    finally:
        server.stop()


# --------------------------------------------------------------------------- Dict/Tuple env


def test_dict_env_describe(dict_env):
    desc = dict_env.desc
    local = make_dict_env()
    assert dict_env.obs_space == local.observation_space
    assert list(dict_env.obs_space.spaces) == ["pos", "grid", "mode", "pair", "name"]
    assert dict_env.action_space == local.action_space
    assert desc["render_mode"] == "rgb_array" and desc["spec_id"] is None
    assert desc["metadata"] == {"render_modes": ["rgb_array"], "render_fps": 7}


def test_dict_env_matches_local_env(dict_env):
    space = dict_env.obs_space
    local = make_dict_env()
    reply, payloads = dict_env.rpc({"op": "reset", "seed": 11, "options": {"note": "x"}})
    obs, info = local.reset(seed=11, options={"note": "x"})
    _assert_obs_equal(space, decode(space, reply["obs"], payloads), obs)
    remote_info = decode_info(reply["info"], payloads)
    assert type(remote_info["start"]) is np.float32 and _plain(remote_info) == _plain(info)
    dict_env.action_space.seed(5)
    for i in range(9):
        action = dict_env.action_space.sample()
        reply, payloads = dict_env.step(action, autoreset=True)
        obs, reward, terminated, truncated, info = local.step(action)
        _assert_obs_equal(space, decode(space, reply["obs"], payloads), obs)
        assert (reply["reward"], reply["terminated"], reply["truncated"]) == (reward, terminated, truncated)
        remote_info = decode_info(reply["info"], payloads)
        assert type(remote_info["t"]) is np.int32 and remote_info["vec"].dtype == np.float32
        assert _plain(remote_info) == _plain(info)
        if terminated:
            assert "episode" in remote_info  # RecordEpisodeStatistics' stats crossed too
            obs, info = local.reset()
            _assert_obs_equal(space, decode(space, reply["reset_obs"], payloads), obs)
            assert _plain(decode_info(reply["reset_info"], payloads)) == _plain(info)
    assert i == 8


def test_dict_env_render_call_get_set_attr(dict_env):
    dict_env.rpc({"op": "reset", "seed": 0})
    dict_env.step((1, np.zeros(2, np.float32)))
    reply, payloads = dict_env.rpc({"op": "render"})
    assert reply["frame"]["__nd__"][1:] == ["|u1", [6, 8, 3]]
    frame = decode_info(reply["frame"], payloads)
    assert frame.dtype == np.uint8 and frame.shape == (6, 8, 3) and (frame[..., 0] == 1).all()

    args, p = encode_info([np.arange(3)])
    kwargs, p = encode_info({"factor": 3}, p)
    reply, payloads = dict_env.rpc({"op": "call", "name": "scale", "args": args, "kwargs": kwargs}, p)
    np.testing.assert_array_equal(decode_info(reply["value"], payloads), [0, 3, 6])
    reply, _ = dict_env.rpc({"op": "call", "name": "render_mode"})  # not callable: its value
    assert reply == {"value": "rgb_array"}
    reply, _ = dict_env.rpc({"op": "get_attr", "name": "scale"})  # get_attr never calls
    assert "bound method" in reply["value"]
    assert dict_env.rpc({"op": "set_attr", "name": "counter", "value": 100})[0] == {}
    assert dict_env.rpc({"op": "get_attr", "name": "counter"})[0] == {"value": 100}
    dict_env.step((0, np.zeros(2, np.float32)))
    assert dict_env.rpc({"op": "get_attr", "name": "counter"})[0] == {"value": 101}

    reply, _ = dict_env.rpc({"op": "get_attr", "name": "no_such_attribute"})
    assert "AttributeError" in reply["error"]
    reply, _ = dict_env.rpc({"op": "call", "name": "scale", "args": [], "kwargs": {"bogus": 1}})
    assert "TypeError" in reply["error"]
    reply, _ = dict_env.rpc({"op": "get_attr", "name": 5})
    assert "error" in reply


def test_dict_env_exceptions_become_terminal_transitions(dict_env):
    dict_env.rpc({"op": "reset", "seed": 0})
    action = (1, np.zeros(2, np.float32))

    dict_env.rpc({"op": "set_attr", "name": "explode", "value": True})
    reply, payloads = dict_env.step(action)
    assert reply["obs"] is None and reply["terminated"] is True and reply["reward"] == 0.0
    exc = reply["info"]["boltzlabs_exception"]
    assert exc["where"] == "step" and "kaboom" in exc["traceback"]
    # With autoreset the failed episode is reset in the same reply.
    reply, payloads = dict_env.step(action, autoreset=True)
    assert reply["info"]["boltzlabs_exception"]["where"] == "step"
    assert decode(dict_env.obs_space, reply["reset_obs"], payloads)["grid"].shape == (4, 4)
    dict_env.rpc({"op": "set_attr", "name": "explode", "value": False})
    reply, payloads = dict_env.step(action)  # still serving
    assert reply["reward"] == 1.0 and "boltzlabs_exception" not in decode_info(reply["info"], payloads)

    dict_env.rpc({"op": "set_attr", "name": "bad_obs", "value": True})
    reply, _ = dict_env.step(action)
    assert reply["info"]["boltzlabs_exception"]["where"] == "encode"
    assert "shape" in reply["info"]["boltzlabs_exception"]["traceback"]
    dict_env.rpc({"op": "set_attr", "name": "bad_obs", "value": False})

    reply, _ = dict_env.rpc({"op": "step", "action": [7, {"__nd__": [0, "<f4", [2]]}]}, [bytes(8)])
    assert reply["info"]["boltzlabs_exception"]["where"] == "action"
    assert "out of range" in reply["info"]["boltzlabs_exception"]["traceback"]

    reply, _ = dict_env.rpc({"op": "reset", "seed": 1, "options": {"boom": True}})
    assert reply["obs"] is None and reply["info"]["boltzlabs_exception"]["where"] == "reset"
    assert "reset boom" in reply["info"]["boltzlabs_exception"]["traceback"]
    reply, _ = dict_env.rpc({"op": "reset", "seed": "one"})
    assert reply["info"]["boltzlabs_exception"]["where"] == "reset"

    reply, payloads = dict_env.rpc({"op": "reset", "seed": 1})
    assert decode(dict_env.obs_space, reply["obs"], payloads)["pos"].dtype == np.float32
    assert "kaboom" in dict_env.stderr_text()  # tracebacks and print()s went to stderr
    assert "hello from __init__" in dict_env.stderr_text()


def test_dict_env_malformed_requests(dict_env):
    assert "bad request" in dict_env.raw(b"this is not json\n")[0]["error"]
    assert "bad request" in dict_env.raw(b"[1, 2]\n")[0]["error"]
    assert "unknown op" in dict_env.rpc({"op": "fly"})[0]["error"]
    assert "unknown op" in dict_env.rpc({"no_op": 1})[0]["error"]
    reply, _ = dict_env.rpc({"op": "describe"})  # still in sync and serving
    assert reply["observation_space"]["type"] == "Dict"


def test_dict_env_close(dict_env):
    assert dict_env.rpc({"op": "close"})[0] == {}
    assert dict_env.proc.wait(timeout=10) == 0


class _BoxEnv(gym.Env):
    """Box observations and actions; switches for each case the step fast path must refuse."""

    observation_space = gs.Box(-10, 10, (2, 3), np.float32)
    action_space = gs.Box(-1, 1, (2,), np.float32)

    def __init__(self):
        self.info, self.reward, self.obs_dtype = {}, 0.5, np.float32

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros((2, 3), np.float32), {}

    def step(self, action):
        obs = np.full((2, 3), float(action.sum()), dtype=self.obs_dtype)
        return obs, self.reward, False, False, self.info


def _generic_step_bytes(server, msg, payloads):
    """What the step reply is through the generic encoders (the fast path switched off)."""
    import io

    leaf, server._obs_leaf = server._obs_leaf, None
    try:
        result = server.step(msg, payloads)
    finally:
        server._obs_leaf = leaf
    buf = io.BytesIO()
    write_message(buf, *result)
    return buf.getvalue()


@pytest.mark.parametrize("case", ["plain", "info", "nan", "other_dtype", "json_action"])
def test_step_fast_path_writes_exactly_what_the_generic_encoders_write(case):
    from boltzlabs_gym.envside.gym_host import GymHost

    fast_env, slow_env = _BoxEnv(), _BoxEnv()
    for env in (fast_env, slow_env):
        env.info = {"k": 1} if case == "info" else {}
        env.reward = float("nan") if case == "nan" else 0.5
        env.obs_dtype = np.float64 if case == "other_dtype" else np.float32
    fast, slow = GymHost(fast_env), GymHost(slow_env)
    action = np.array([0.25, 0.5], np.float32)
    if case == "json_action":
        msg, payloads = {"op": "step", "action": [0.25, 0.5]}, []
    else:
        skeleton, payloads = encode(fast.action_space, action)
        msg = {"op": "step", "action": skeleton}
    got = fast.handle(msg, payloads)
    expected = _generic_step_bytes(slow, msg, payloads)
    if case == "info":
        # An info of numbers takes the fast path too, as one row of typed columns: the same
        # transition, read back through the generic decoders.
        assert type(got) is bytes, "an array obs with an info of numbers takes the fast path"
        (fast_reply, fast_payloads), (slow_reply, slow_payloads) = (
            read_message(__import__("io").BytesIO(bytes(data))) for data in (got, expected)
        )
        assert "__cols__" in fast_reply["info"]
        assert decode_info(fast_reply["info"], fast_payloads) == decode_info(slow_reply["info"], slow_payloads)
        for reply, own in ((fast_reply, fast_payloads), (slow_reply, slow_payloads)):
            np.testing.assert_array_equal(decode(fast.obs_space, reply["obs"], own), np.full((2, 3), 0.75, np.float32))
        return
    if case == "plain" or case == "json_action":
        assert type(got) is bytes, "an array obs with an empty info takes the fast path"
    else:
        import io

        assert isinstance(got, tuple), f"{case}: the fast path must step aside"
        buf = io.BytesIO()
        write_message(buf, *got)
        got = buf.getvalue()
    assert bytes(got) == expected
    reply, obs_payloads = read_message(__import__("io").BytesIO(expected))
    obs = decode(fast.obs_space, reply["obs"], obs_payloads)
    np.testing.assert_array_equal(obs, np.full((2, 3), 0.75, np.float32))


def test_discrete_fast_decode_refuses_what_the_codec_refuses():
    from boltzlabs_gym.envside.gym_host import GymHost

    server = GymHost(gym.make("CartPole-v1"))
    server.reset({"seed": 0}, [])
    for bad in (2, -1, True, 1.0, "1"):
        reply, _ = server.step({"op": "step", "action": bad}, [])
        assert reply["terminated"] and reply["info"]["boltzlabs_exception"]["where"] == "action", bad
    server.reset({"seed": 0}, [])
    assert type(server.step({"op": "step", "action": 1}, [])) is bytes


class _LoopHarness:
    """``serve_one`` on a thread, over two real pipes, as a sandboxed env runs it."""

    def __init__(self, env):
        import threading

        from boltzlabs_gym.envside.framing import FdReader
        from boltzlabs_gym.envside.gym_host import GymHost
        from boltzlabs_gym.envside.gym_loops import serve_one

        self.server = GymHost(env)
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.replies = FdReader(self.rep_r)
        self.fds = (req_r, rep_w)
        self.thread = threading.Thread(target=serve_one, args=(self.server, req_r, rep_w), daemon=True)
        self.thread.start()

    def send(self, data: bytes):
        os.write(self.req_w, data)

    def reply(self):
        return read_message(self.replies)

    def close(self):
        os.close(self.req_w)
        self.thread.join(10)
        assert not self.thread.is_alive(), "the loop must end at end of input"
        for fd in (*self.fds, self.rep_r):
            os.close(fd)


def _generic_reply(env_seed: int, actions: list, autoreset: bool = False):
    """Replies of the same env driven through the generic (JSON) path only."""
    from boltzlabs_gym.envside.gym_host import GymHost

    server = GymHost(gym.make("CartPole-v1"))
    server._discrete = None  # the Discrete hot path off: every action through the codec
    server._obs_leaf = None
    server.reset({"seed": env_seed}, [])
    out = []
    for a in actions:
        op = {"op": "step", "action": a, **({"autoreset": True} if autoreset else {})}
        reply, payloads = server.step(op, [])
        out.append((to_json_safe(reply), [bytes(p) for p in payloads]))
        if reply["terminated"] and not autoreset:
            break
    return out


@pytest.mark.parametrize("autoreset", [False, True], ids=["plain", "same_step_autoreset"])
def test_serve_loop_discrete_hot_path_matches_the_generic_path(autoreset):
    from boltzlabs_gym.wire.protocol import env_request_line

    loop = _LoopHarness(gym.make("CartPole-v1"))
    try:
        loop.send(b'{"op":"reset","seed":3}\n')
        loop.reply()
        # Always pushing right ends the episode within a few dozen steps: with autoreset the
        # terminal reply carries the reset, in the same reply, as the generic path writes it.
        actions = [1] * 40
        ends = 0
        for a, (want, want_payloads) in zip(actions, _generic_reply(3, actions, autoreset)):
            op = {"op": "step", "action": a, **({"autoreset": True} if autoreset else {})}
            line = env_request_line(op)
            assert b"{" not in line[1:], "a Discrete step is written without the JSON encoder"
            loop.send(line)
            got, payloads = loop.reply()
            got.pop("_bin", None)
            want = {k: v for k, v in want.items() if k != "_bin"}
            assert got == want
            assert payloads == want_payloads
            ends += got["terminated"]
            if got["terminated"] and not autoreset:
                break
        assert ends >= 1
    finally:
        loop.close()


def test_serve_loop_hot_path_steps_aside_for_anything_it_does_not_recognise():
    loop = _LoopHarness(gym.make("CartPole-v1"))
    try:
        loop.send(b'{"op":"reset","seed":0}\n')
        assert loop.reply()[0]["info"] == {}
        # Out of range, negative, huge: answered by the generic path, which reports them.
        for bad in (b"2", b"-1", b"9" * 30):
            loop.send(b'{"op":"step","action":' + bad + b"}\n")
            reply, _ = loop.reply()
            assert reply["info"]["boltzlabs_exception"]["where"] == "action", bad
        # Two requests in one read, and one split across two writes: both answered, in order.
        loop.send(b'{"op":"step","action":1}\n{"op":"describe"}\n')
        assert loop.reply()[0]["reward"] == 1.0
        assert loop.reply()[0]["server"] == "gym"
        loop.send(b'{"op":"step","act')
        loop.send(b'ion":0}\n')
        assert loop.reply()[0]["reward"] == 1.0
        # Not JSON: answered with an error, and the loop keeps serving.
        loop.send(b"garbage\n")
        assert "bad request" in loop.reply()[0]["error"]
        loop.send(b'{"op":"step","action":0}\n')
        assert loop.reply()[0]["reward"] == 1.0
    finally:
        loop.close()


def test_fd_reader_lines_and_payloads_across_reads():
    from boltzlabs_gym.envside.framing import FdReader, FdWriter

    r, w = os.pipe()
    try:
        reader, writer = FdReader(r), FdWriter(w)
        writer.write(b"abc")
        writer.write(b"def\nxy")
        assert reader.readline(100) == b"abcdef\n"
        writer.write(b"z\n")
        assert reader.readline(2) == b"xy", "the limit bounds a line"
        assert reader.readline(100) == b"z\n"
        writer.write(memoryview(np.arange(3, dtype=np.float32)))  # counted in bytes, not items
        assert reader.read(12) == np.arange(3, dtype=np.float32).tobytes()
        reader.push(b"back\n")
        assert reader.readline() == b"back\n"
        writer.write(b"tail")
    finally:
        os.close(w)
    assert reader.read(10) == b"tail", "fewer bytes at end of stream"
    assert reader.readline(10) == b""
    os.close(r)


def test_parse_discrete_step_reads_exactly_what_env_request_line_writes():
    from boltzlabs_gym.wire.protocol import env_request_line, parse_discrete_step

    for action in (0, 1, 7, 10**18):
        for autoreset in (False, True):
            op = {"op": "step", "action": action, **({"autoreset": True} if autoreset else {})}
            assert parse_discrete_step(env_request_line(op)) == (action, autoreset)
    for other in (b'{"op":"step","action":-1}\n', b'{"op":"step","action":1}', b'{"op":"step","action":}\n',
                  b'{"op":"step","action":1,"autoreset":false}\n', b'{"op":"step","action":1}\n{"op":"close"}\n',
                  b'{"op":"step","action":' + b"9" * 60 + b"}\n", b'{"op":"reset","seed":1}\n', b""):
        assert parse_discrete_step(other) is None, other


# --------------------------------------------------------------------------- the env's heap


class _Cycle:
    """A reference cycle whose collection is counted (only the cyclic GC can free it)."""

    collected = 0

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cycle.collected += 1


class GcProbeEnv(gym.Env):
    """Makes one garbage reference cycle per step and reports on the interpreter's GC."""

    observation_space = gs.Box(-1, 1, (2,), np.float32)
    action_space = gs.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        _Cycle()
        return np.zeros(2, np.float32), 1.0, False, False, {}

    def gc_state(self):
        import gc

        return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "collected": _Cycle.collected}


def test_gym_host_freezes_the_heap_it_was_built_with_and_still_collects_new_garbage(tmp_path):
    server = Server(tmp_path, [GcProbeEnv], -1)
    try:
        state = server.rpc({"op": "call", "name": "gc_state"})[0]["value"]
        # Gymnasium, NumPy and the env itself: tens of thousands of objects the collector
        # would otherwise walk again and again while the env steps.
        assert state["enabled"] and state["frozen"] > 10_000, state
        server.rpc({"op": "reset", "seed": 0})
        for _ in range(3000):
            reply, _ = server.rpc({"op": "step", "action": 1})  # the Discrete hot path
            assert reply["reward"] == 1.0
        state = server.rpc({"op": "call", "name": "gc_state"})[0]["value"]
        assert state["collected"] > 2000, state  # the cycles made while serving are still collected
    finally:
        server.stop()


def test_json_env_server_freezes_its_heap_before_serving(tmp_path):
    (tmp_path / "env.py").write_text(
        "import gc\n"
        "from boltzlabs_gym.env import serve\n"
        "serve(reset=lambda seed: gc.get_freeze_count(), step=lambda a: (gc.get_freeze_count(), 0.0, False, {}))\n"
    )
    proc = subprocess.Popen([sys.executable, "env.py"], cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        write_message(proc.stdin, {"op": "reset", "seed": 0})
        reply, _ = read_message(proc.stdout)
        assert reply["obs"] > 1000, reply
    finally:
        proc.kill()
        proc.wait()
