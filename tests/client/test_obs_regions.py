"""Shared observation regions (``RLPool(shared_obs=True)``): the same results as SyncVectorEnv, and
the trust rules held against hostile envs.

Real worker, real sandboxes, real memfds. The hostile envs are factories that change their own
process's env side (they run inside the sandbox, as untrusted code would): they lie in the
``obs_region`` answer, write references they may not write, rewrite their slot after replying,
or try to change the size of their memfd.
"""

from __future__ import annotations

import os
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode

from boltzlabs_gym import BoltzLabsVecEnv, RLPool
from boltzlabs_gym.vector.factory_env_dir import write_factory_env_dir
from conftest import ISOLATION

MEMFD = "memfd:boltzlabs-obs"
SHAPE = (6, 5, 3)
INFO_SHAPE = (64, 64, 3)


class FrameEnv(gym.Env):
    """Small uint8 frames, episodes of 3-8 steps, an info on every fourth step (those go as bytes)."""

    def __init__(self):
        self.observation_space = spaces.Box(0, 255, SHAPE, np.uint8)
        self.action_space = spaces.Discrete(3)
        self.t = 0
        self.length = 5

    def _obs(self, action: int = 0):
        return ((self.np_random.integers(0, 256, SHAPE) + action) % 256).astype(np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.length = int(self.np_random.integers(3, 9))
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        info = {"t": self.t} if self.t % 4 == 0 else {}
        return self._obs(int(action)), float(action) + 0.5, self.t >= self.length, False, info


def make_frames():
    return FrameEnv()


# ------------------------------------------------------------------ hostile envs
def _patch_step_line(rewrite):
    """In this env process: every shared-region step line goes out rewritten by ``rewrite``."""
    from boltzlabs_gym.wire import codec

    honest = codec.ArrayLeaf.shm_step_reply

    def lying(self, *args):
        line = honest(self, *args)
        return rewrite(line) if line is not None else None

    codec.ArrayLeaf.shm_step_reply = lying


def make_wrong_slot():
    _patch_step_line(lambda line: line.replace(b'"__shm__":[0,', b'"__shm__":[1,'))
    return FrameEnv()


def make_wrong_dtype():
    _patch_step_line(lambda line: line.replace(b'"|u1"', b'"<f4"'))
    return FrameEnv()


def make_wrong_shape():
    _patch_step_line(lambda line: line.replace(b"[6,5,3]", b"[5,6,3]"))
    return FrameEnv()


class InfoFrameEnv(FrameEnv):
    """FrameEnv whose every step has an info of numbers, as ALE's (``lives``, frame counters), and
    frames large enough (12 KiB) for their bytes to show beside the reply lines'."""

    def __init__(self):
        super().__init__()
        self.observation_space = spaces.Box(0, 255, INFO_SHAPE, np.uint8)

    def _obs(self, action: int = 0):
        return ((self.np_random.integers(0, 256, INFO_SHAPE) + action) % 256).astype(np.uint8)

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {"lives": np.int64(3 - self.t % 3), "frame": self.t * 4}


def make_info_frames():
    return InfoFrameEnv()


def make_wrong_slot_with_info():
    _patch_step_line(lambda line: line.replace(b'"__shm__":[0,', b'"__shm__":[1,'))
    return InfoFrameEnv()


def make_reference_without_region():
    """Refuses a region, then refers to one anyway (and writes its observation nowhere)."""
    from boltzlabs_gym.envside import gym_host
    from boltzlabs_gym.wire import codec

    def no_region(self, msg, payloads):
        return {"error": "no region here"}, []

    def reference(self, obs, reward, terminated, truncated):
        return (
            self.shm_prefix + repr(float(reward)).encode() + b',"terminated":false,"truncated":false' + self.shm_suffix
        )

    gym_host.GymHost.obs_region = no_region
    gym_host._OTHER_OPS["obs_region"] = no_region
    codec.ArrayLeaf.step_reply = reference
    return FrameEnv()


def _patch_region_reply(change):
    from boltzlabs_gym.envside import gym_host

    honest = gym_host.region_reply
    gym_host.region_reply = lambda region, leaf: {"obs_region": change(dict(honest(region, leaf)["obs_region"]))}


def make_lies_about_fd():
    _patch_region_reply(lambda r: dict(r, fd=0))  # its stdin: no memfd
    return FrameEnv()


def make_lies_about_size():
    _patch_region_reply(lambda r: dict(r, bytes=r["bytes"] * 4))
    return FrameEnv()


class RewritingEnv(FrameEnv):
    """After its first step, a thread of its own keeps writing 0xFF over its slot."""

    def step(self, action):
        out = super().step(action)
        if not getattr(self, "_writer", None):
            from boltzlabs_gym.envside import obs_region

            region = obs_region.current()
            if region is not None:

                def scribble():
                    while True:
                        region.memory[: region.slot_bytes] = b"\xff" * region.slot_bytes
                        time.sleep(0.0005)

                self._writer = threading.Thread(target=scribble, daemon=True)
                self._writer.start()
        return out[0], out[1], out[2], out[3], {}


def make_rewriting():
    return RewritingEnv()


class ResizingEnv(FrameEnv):
    """Tries to shrink, then grow, its memfd on every step; says what happened in its info."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        from boltzlabs_gym.envside import obs_region

        region = obs_region.current()
        tried = {}
        for name, size in (("shrink", 0), ("grow", 1 << 24)):
            try:
                os.ftruncate(region.fd, size)
                tried[name] = "done"
            except OSError as exc:
                tried[name] = exc.strerror
        return obs, reward, False, False, {"resize": tried}


def make_resizing():
    from boltzlabs_gym.envside import obs_region

    obs_region.ObsRegion.close_fd = lambda self: None  # keeps its descriptor to the memfd
    return ResizingEnv()


# ------------------------------------------------------------------ helpers
def _pool(factory, n: int, tmp_path_factory, **options) -> RLPool:
    env_dir = write_factory_env_dir(tmp_path_factory.mktemp("factories"), [factory])
    return RLPool(env_dir, n, isolation=ISOLATION, step_timeout=20.0, **options)


def _mapped(pid: int | str = "self") -> int:
    """How many mappings of observation memfds process ``pid`` has."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(MEMFD in line for line in f)


@pytest.fixture
def mapped():
    """:func:`_mapped` for this process, less what the module's shared pool holds."""
    base = _mapped()
    return lambda: _mapped() - base


@pytest.fixture
def memfds():
    """:func:`_open_memfds` for this process, less what the module's shared pool holds."""
    base = _open_memfds()
    return lambda: _open_memfds() - base


def _open_memfds(pid: int | str = "self") -> int:
    """How many descriptors of observation memfds process ``pid`` holds."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/" + MEMFD)
        except OSError:
            pass
    return count


def _vec(pool: RLPool, **kwargs) -> BoltzLabsVecEnv:
    return BoltzLabsVecEnv(pool=pool, **kwargs)


def _detach(venv: BoltzLabsVecEnv) -> None:
    """Let go of a vector env without closing the module's pool under it."""
    venv._pool = None
    venv.closed = True


def _compare(
    ours: BoltzLabsVecEnv, mode: AutoresetMode, copy: bool, n: int, steps: int = 24, factory=make_frames
) -> None:
    ref = gym.vector.SyncVectorEnv([factory] * n, autoreset_mode=mode, copy=copy)
    try:
        got, want = ours.reset(seed=11), ref.reset(seed=11)
        np.testing.assert_array_equal(got[0], want[0])
        previous = (got[0], want[0])
        rng = np.random.default_rng(5)
        ends = 0
        for t in range(steps):
            actions = rng.integers(0, 3, n)
            got, want = ours.step(actions), ref.step(actions)
            for name, a, b in zip(("obs", "reward", "terminated", "truncated"), got[:4], want[:4]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} differs at step {t} ({mode}, copy={copy})")
            assert got[4].keys() == want[4].keys(), t
            for key in ("lives", "_lives", "frame", "_frame"):
                if key in want[4]:
                    assert data_equivalence(got[4][key], want[4][key], exact=True), (key, t)
            if "final_obs" in want[4]:
                for i in np.flatnonzero(want[4]["_final_obs"]):
                    np.testing.assert_array_equal(got[4]["final_obs"][i], want[4]["final_obs"][i])
            # copy= as Gymnasium's vectorizers: the same batch object every step without it
            assert (got[0] is previous[0]) == (want[0] is previous[1]), f"copy={copy} at step {t}"
            previous = (got[0], want[0])
            done = np.logical_or(got[2], got[3])
            ends += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                got_r = ours.reset(options={"reset_mask": done})
                want_r = ref.reset(options={"reset_mask": done})
                np.testing.assert_array_equal(got_r[0], want_r[0])
                previous = (got_r[0], want_r[0])
        assert ends > 0, "no episode ended: autoreset was not exercised"
    finally:
        ref.close()


# ------------------------------------------------------------------ same results
N = 4


@pytest.fixture(
    scope="module",
    params=[(1, True), (1, False), (2, True), (2, False)],
    ids=lambda p: f"k{p[0]}-{'lane' if p[1] else 'worker'}",
)
def frames_pool(request, tmp_path_factory):
    k, direct = request.param
    pool = _pool(make_frames, N, tmp_path_factory, envs_per_sandbox=k, direct=direct)
    yield pool
    pool.close()


def test_same_results_as_sync_vector_env(frames_pool):
    """Every autoreset mode, with and without ``copy``: step for step SyncVectorEnv's results, and
    the observations came through the regions (one per sandbox, mapped once each)."""
    link = frames_pool._links[0]
    for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED):
        for copy in (True, False):
            venv = _vec(frames_pool, autoreset_mode=mode, copy=copy)
            try:
                _compare(venv, mode, copy, N)
            finally:
                _detach(venv)
    sandboxes = frames_pool.layout.sandboxes
    assert link.regions is not None and len(link.regions) == sandboxes, link.regions.refused
    assert _mapped() == sandboxes
    assert _open_memfds() == sandboxes  # the one Python's mmap keeps per mapping, no more
    assert _open_memfds(link.process.pid) == 0  # the worker passed them on and closed its own


def _region_arrays(pool: RLPool) -> list[np.ndarray]:
    """Every mapped region of ``pool``, as a byte array over its mapping."""
    regions = pool._links[0].regions
    assert regions is not None
    return [np.frombuffer(region.map, dtype=np.uint8) for region in regions._regions.values()]


def _arrays_in(value) -> list[np.ndarray]:
    if isinstance(value, np.ndarray):
        return [value] + (_arrays_in(list(value)) if value.dtype == object else [])
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays_in(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays_in(v)]
    return []


def test_nothing_returned_views_a_region(frames_pool):
    """The vector env's step reads observations in place and copies each into its batch: no
    array it returns (observations with or without ``copy``, ``final_obs`` in infos) shares
    memory with a region, and the regions are back to copying once the step returned."""
    regions = frames_pool._links[0].regions
    for mode in (AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP):
        for copy in (True, False):
            venv = _vec(frames_pool, autoreset_mode=mode, copy=copy)
            try:
                venv.reset(seed=3)
                rng = np.random.default_rng(1)
                ends = 0
                for _ in range(12):
                    step = venv.step(rng.integers(0, 3, N))
                    assert not regions.views
                    ends += int(np.logical_or(step[2], step[3]).sum())
                    shared = _region_arrays(frames_pool)
                    in_place = np.frombuffer(regions._regions[0].view_rows(1), np.uint8)
                    assert shared and np.shares_memory(in_place, shared[0])  # what the check looks for
                    del in_place
                    for array in _arrays_in(list(step)):
                        assert not any(np.shares_memory(array, region) for region in shared), (mode, copy)
                assert ends > 0
            finally:
                _detach(venv)


@pytest.mark.parametrize("direct", [True, False], ids=["lane", "worker"])
def test_a_step_with_an_info_of_numbers_brings_its_observation_through_the_region(direct, tmp_path_factory):
    """An env whose every step has an info of numbers (ALE's, MuJoCo's) still writes its observation
    into its slot, not down its pipe: SyncVectorEnv's results in every autoreset mode, and far
    fewer bytes read by this process per step than the observations it got."""
    pool = _pool(make_info_frames, N, tmp_path_factory, direct=direct)
    try:
        for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED):
            venv = _vec(pool, autoreset_mode=mode)
            try:
                _compare(venv, mode, True, N, factory=make_info_frames)
            finally:
                _detach(venv)
        venv = _vec(pool)
        try:
            venv.reset(seed=1)
            read_before, steps = _bytes_read(), 40
            for _ in range(steps):
                venv.step(np.zeros(N, dtype=np.int64))
            read, obs_bytes = _bytes_read() - read_before, steps * N * int(np.prod(INFO_SHAPE))
            assert read < obs_bytes / 4, (read, obs_bytes)
        finally:
            _detach(venv)
    finally:
        pool.close()


def _bytes_read() -> int:
    """What this process has read through read system calls (``/proc/self/io``'s ``rchar``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_same_results_without_regions(tmp_path_factory, mapped, memfds):
    """``shared_obs=False``: bytes on the pipes, the same results."""
    pool = _pool(make_frames, N, tmp_path_factory, envs_per_sandbox=2, shared_obs=False)
    try:
        assert pool._links[0].regions is None
        venv = _vec(pool, autoreset_mode=AutoresetMode.SAME_STEP)
        _compare(venv, AutoresetMode.SAME_STEP, True, N)
        _detach(venv)
        assert mapped() == 0
    finally:
        pool.close()


def test_hard_reset_maps_a_fresh_region_and_close_leaks_nothing(tmp_path_factory, mapped, memfds):
    pool = _pool(make_frames, 2, tmp_path_factory)
    link = pool._links[0]
    venv = _vec(pool)
    try:
        venv.reset(seed=1)
        venv.step(np.array([1, 2]))
        assert len(link.regions) == 2 and mapped() == 2
        pool.reset(hard=True)
        assert mapped() == 0  # the replaced processes' regions are unmapped
        obs, *_ = venv.step(np.array([0, 1]))  # asked again first
        assert len(link.regions) == 2 and mapped() == 2
        assert obs.shape == (2, *SHAPE)
    finally:
        venv.close()
    assert mapped() == 0 and memfds() == 0


# ------------------------------------------------------------------ hostile envs
@pytest.mark.parametrize(
    "factory",
    [
        make_wrong_slot,
        make_wrong_dtype,
        make_wrong_shape,
        make_reference_without_region,
        make_wrong_slot_with_info,
        "make_dict_wrong_count",
        "make_dict_marker_and_bytes",
        "make_dict_marker_without_region",
    ],
    ids=lambda f: f if isinstance(f, str) else f.__name__,
)
def test_a_wrong_reference_is_the_envs_fault(factory, tmp_path_factory):
    """A reference to another slot, dtype or shape, or from an env with no region, is that env's
    broken protocol: reported in its info, the env restarted (its region with it). So are a Dict
    observation's payloads said to be in the region wrongly (another count, the bytes sent as
    well, or no region at all)."""
    pool = _pool(globals()[factory] if isinstance(factory, str) else factory, 1, tmp_path_factory)
    venv = _vec(pool)
    try:
        venv.reset(seed=0)
        _, _, terminated, truncated, info = venv.step(np.array([1]))
        assert truncated[0] and not terminated[0]
        reason = info["boltzlabs_error"]["reason"][0]
        assert "broke the protocol" in reason and "region" in reason, reason
        obs, info = venv.reset(seed=0)  # restarted: it serves again
        if isinstance(factory, str):  # the Dict liars lie in their resets' replies too: caught again
            assert "broke the protocol" in info["boltzlabs_error"]["reason"][0], info
        else:
            assert obs.shape == (1, *venv.single_observation_space.shape) and "boltzlabs_error" not in info, info
    finally:
        venv.close()


@pytest.mark.parametrize("factory", [make_lies_about_fd, make_lies_about_size])
def test_a_region_described_wrongly_is_refused(factory, tmp_path_factory, mapped, memfds):
    """The worker checks what the env says of its region: a descriptor that is no memfd, or a
    size it does not have, is refused, and the env's observations come as bytes, correct."""
    pool = _pool(factory, 1, tmp_path_factory)
    venv = _vec(pool)
    ref = gym.vector.SyncVectorEnv([make_frames])
    try:
        np.testing.assert_array_equal(venv.reset(seed=4)[0], ref.reset(seed=4)[0])
        for a in (0, 1, 2):
            np.testing.assert_array_equal(venv.step(np.array([a]))[0], ref.step(np.array([a]))[0])
        regions = pool._links[0].regions
        assert len(regions) == 0 and "no shared observation region" in regions.refused[0]
        assert mapped() == 0
    finally:
        venv.close()
        ref.close()


def test_an_env_rewriting_its_slot_changes_nothing_returned(tmp_path_factory):
    """The slot is copied out as the reply is read: what was returned stays as it was."""
    pool = _pool(make_rewriting, 1, tmp_path_factory)
    venv = _vec(pool, copy=True)
    try:
        venv.reset(seed=2)
        returned = [venv.step(np.array([a]))[0] for a in (0, 1, 2, 0)]
        kept = [obs.copy() for obs in returned]
        time.sleep(0.05)  # the env's thread scribbles over its slot meanwhile
        for obs, copy in zip(returned, kept):
            np.testing.assert_array_equal(obs, copy)
        assert len(pool._links[0].regions) == 1
    finally:
        venv.close()


def test_an_env_cannot_resize_its_region(tmp_path_factory, mapped, memfds):
    """Sealed by the worker: shrinking and growing fail in the env, and the pool reads on."""
    pool = _pool(make_resizing, 1, tmp_path_factory)
    venv = _vec(pool)
    try:
        venv.reset(seed=3)
        for a in (0, 1, 2):
            obs, _, _, _, info = venv.step(np.array([a]))
            assert info["resize"]["shrink"][0] == "Operation not permitted", info
            assert info["resize"]["grow"][0] == "Operation not permitted", info
        assert len(pool._links[0].regions) == 1 and mapped() == 1
        np.asarray(pool._links[0].regions._regions[0].map[:])  # the whole mapping reads: no SIGBUS
    finally:
        venv.close()


def _memfd_inodes() -> set[str]:
    """The inodes of the observation memfds this process maps."""
    with open("/proc/self/maps") as f:
        return {line.split()[4] for line in f if MEMFD in line}


def test_a_memory_snapshot_copy_never_writes_into_its_sources_region(tmp_path_factory, mapped):
    """A copy forked from a held env shares its memory, mapping included: it drops that region
    before serving and gets one of its own, so each env's observations stay its own."""
    env_dir = write_factory_env_dir(tmp_path_factory.mktemp("factories"), [make_frames])
    venv = BoltzLabsVecEnv.from_env_dir(env_dir, 3, mode="boltz", isolation="namespaces")
    try:
        if venv.pool.isolation is None or venv.pool.isolation.backend != "namespaces":  # pragma: no cover
            pytest.skip("memory snapshots need the namespaces backend (root)")
        ref = FrameEnv()
        venv.reset(seed=[9, 1, 2])
        ref.reset(seed=9)
        venv.step(np.array([1, 1, 1]))  # with its region in use
        ref.step(1)
        before = _memfd_inodes()
        snap = venv.snapshot(0, kind="memory")
        assert snap.kind == "memory", snap.kind
        venv.restore(snap, [1, 2])
        snap.release()
        obs = venv.step(np.array([0, 1, 2]))[0]  # the copies go on from env 0's state
        np.testing.assert_array_equal(obs[0], ref.step(0)[0])
        for a in (1, 2):  # the same random stream, their own action: never env 0's bytes
            np.testing.assert_array_equal(obs[a], (obs[0].astype(int) + a) % 256)
        assert len(venv.pool._links[0].regions) == 3 and mapped() == 3
        # three regions, three memfds: the copies' are their own (and the source was asked again)
        assert len(_memfd_inodes() - before) == 3
    finally:
        venv.close()


# ------------------------------------------------------------------ Dict and Tuple observations
class DictFrameEnv(FrameEnv):
    """FrameEnv's frames in a Dict beside a float vector, a MultiBinary, a Discrete and a Text
    (inline on the wire): three payloads, at fixed sizes."""

    def __init__(self):
        super().__init__()
        self.observation_space = spaces.Dict(
            {
                "frame": spaces.Box(0, 255, SHAPE, np.uint8),
                "pos": spaces.Box(-10.0, 10.0, (2,), np.float32),
                "bits": spaces.MultiBinary(3),
                "heading": spaces.Discrete(4),
                "mission": spaces.Text(12),
            }
        )

    def _obs(self, action: int = 0):
        frame = super()._obs(action)
        return {
            "frame": frame,
            "pos": np.array([self.t, action - 0.5], np.float32),
            "bits": (frame[0, 0, :3] % 2).astype(np.int8),
            "heading": int(frame[0, 0, 0] % 4),
            "mission": f"step {self.t}",
        }


class TupleFrameEnv(FrameEnv):
    """FrameEnv's frames in a Tuple beside a nested Dict of an int vector."""

    def __init__(self):
        super().__init__()
        inner = spaces.Dict({"count": spaces.Box(0, 100, (1,), np.int64)})
        self.observation_space = spaces.Tuple((spaces.Box(0, 255, SHAPE, np.uint8), inner))

    def _obs(self, action: int = 0):
        return super()._obs(action), {"count": np.array([self.t], np.int64)}


def make_dict_frames():
    return DictFrameEnv()


def make_tuple_frames():
    return TupleFrameEnv()


def _assert_same(got, want, what: str) -> None:
    assert data_equivalence(got, want, exact=True), f"{what}: {got} != {want}"


def _compare_any(ours: BoltzLabsVecEnv, factory, mode: AutoresetMode, copy: bool, n: int, steps: int = 20) -> None:
    """:func:`_compare` for any observation space: nested Dict/Tuple batches."""
    ref = gym.vector.SyncVectorEnv([factory] * n, autoreset_mode=mode, copy=copy)
    try:
        got, want = ours.reset(seed=7), ref.reset(seed=7)
        _assert_same(got[0], want[0], "reset obs")
        rng = np.random.default_rng(2)
        ends = 0
        for t in range(steps):
            actions = rng.integers(0, 3, n)
            got, want = ours.step(actions), ref.step(actions)
            _assert_same(got[0], want[0], f"obs at step {t} ({mode}, copy={copy})")
            for name, a, b in zip(("reward", "terminated", "truncated"), got[1:4], want[1:4]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} differs at step {t}")
            if "final_obs" in want[4]:
                for i in np.flatnonzero(want[4]["_final_obs"]):
                    _assert_same(got[4]["final_obs"][i], want[4]["final_obs"][i], f"final_obs[{i}] at step {t}")
            done = np.logical_or(got[2], got[3])
            ends += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                _assert_same(
                    ours.reset(options={"reset_mask": done})[0],
                    ref.reset(options={"reset_mask": done})[0],
                    f"partial reset at step {t}",
                )
        assert ends > 0, "no episode ended: autoreset was not exercised"
    finally:
        ref.close()


def _compare_in_every_mode(pool: RLPool, factory, n: int, prepare=None) -> None:
    """:func:`_compare_any` in every autoreset mode, with and without ``copy`` (``prepare`` sees
    each vector env first); then nothing a step returns views a region of ``pool``."""
    for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED):
        for copy in (True, False):
            venv = _vec(pool, autoreset_mode=mode, copy=copy)
            if prepare is not None:
                prepare(venv)
            try:
                _compare_any(venv, factory, mode, copy, n)
                step = venv.step(np.zeros(n, np.int64))
                shared = _region_arrays(pool)
                for array in _arrays_in(list(step)):
                    assert not any(np.shares_memory(array, region) for region in shared), (mode, copy)
                del shared  # (arrays over the mappings: they would keep them mapped)
            finally:
                _detach(venv)


@pytest.mark.parametrize("direct", [True, False], ids=["lane", "worker"])
@pytest.mark.parametrize("factory", [make_dict_frames, make_tuple_frames], ids=["dict", "tuple"])
def test_dict_and_tuple_observations_go_through_regions(factory, direct, tmp_path_factory, mapped, memfds):
    """A Dict/Tuple observation of fixed-size arrays (beside Discrete and Text leaves) has its
    arrays' bytes in the region, back to back: SyncVectorEnv's results in every autoreset mode,
    nothing returned views the region, and nothing leaks."""
    pool = _pool(factory, N, tmp_path_factory, direct=direct)
    regions = pool._links[0].regions
    try:
        _compare_in_every_mode(pool, factory, N)
        assert regions is not None and len(regions) == N, regions.refused
        assert all(region.spans is not None and len(region.spans) >= 2 for region in regions._regions.values())
        # Arrays only (the Tuple): a plain step is one fixed line, the pool puts the skeleton back.
        # With Discrete and Text leaves (the Dict): every reply is encoded, its payloads marked.
        arrays_only = factory is make_tuple_frames
        assert all((region.skeleton is not None) == arrays_only for region in regions._regions.values())
        assert mapped() == N and memfds() == N
    finally:
        pool.close()
    assert mapped() == 0 and memfds() == 0


@pytest.mark.parametrize("direct", [True, False], ids=["lane", "worker"])
def test_arrays_only_observations_in_a_sandbox_of_several_envs_go_through_regions(
    direct, tmp_path_factory, mapped, memfds
):
    """Several envs per sandbox with a Tuple of arrays only (5 envs, 2 per sandbox: the last one
    hosts one): one region per sandbox holding each array's rows, read by whole sandboxes into
    the batch. SyncVectorEnv's results in every autoreset mode, nothing returned views a region,
    and nothing leaks."""
    n = 5
    pool = _pool(make_tuple_frames, n, tmp_path_factory, envs_per_sandbox=2, direct=direct)
    regions = pool._links[0].regions
    taken = []

    def count_rows(venv: BoltzLabsVecEnv) -> None:
        sandbox_rows = venv._batch.sandbox_rows  # where a sandbox's rows go into the batch
        set_rows = sandbox_rows.set_rows
        sandbox_rows.set_rows = lambda leaves, at, positions: (
            taken.append(len(leaves)) or set_rows(leaves, at, positions)
        )

    try:
        _compare_in_every_mode(pool, make_tuple_frames, n, count_rows)
        assert regions is not None and len(regions) == 3, regions.refused
        described = sorted((r.slots, len(r.spans), r.skeleton is not None) for r in regions._regions.values())
        assert described == [(1, 2, True), (2, 2, True), (2, 2, True)]
        assert taken and set(taken) == {2}  # whole sandboxes' rows: both arrays of the Tuple
        assert mapped() == 3 and memfds() == 3
    finally:
        pool.close()
    assert mapped() == 0 and memfds() == 0


def make_sandbox_rows_and_bytes():
    """Its sandbox replies refer to the rows in its region and send the first array's bytes too."""
    from boltzlabs_gym.envside import sandbox_rows

    honest_payloads, honest_parts = sandbox_rows.SandboxRows.payloads, sandbox_rows.SandboxRows._line_parts
    row = int(np.prod(SHAPE))

    def payloads(self, n):
        out = honest_payloads(self, n)
        if self.shared:
            out[0] = bytes(row * n)
        return out

    def parts(self, n):
        arrays, line = honest_parts(self, n)
        return arrays, line.replace(b'"_bin":[0,', b'"_bin":[%d,' % (row * n)) if self.shared else line

    sandbox_rows.SandboxRows.payloads = payloads
    sandbox_rows.SandboxRows._line_parts = parts
    return TupleFrameEnv()


class SteadyTupleFrameEnv(TupleFrameEnv):
    """TupleFrameEnv without infos or ends: every step plain."""

    def step(self, action):
        self.t += 1
        return self._obs(int(action)), 0.5, False, False, {}


class SteadyFrameEnv(FrameEnv):
    """FrameEnv without infos or ends: every step plain."""

    step = SteadyTupleFrameEnv.step


def make_frame_rows_then_bytes():
    return _lie_after_four_sandbox_replies(SteadyFrameEnv())


def make_tuple_rows_then_bytes():
    return _lie_after_four_sandbox_replies(SteadyTupleFrameEnv())


def _lie_after_four_sandbox_replies(env):
    """Honest for four sandbox replies through its region (a reset's and three steps'), then as
    :func:`make_sandbox_rows_and_bytes`: the same line it sent before is what its reader
    remembers, and the lie is another line."""
    from boltzlabs_gym.envside import sandbox_rows

    honest_payloads, honest_parts = sandbox_rows.SandboxRows.payloads, sandbox_rows.SandboxRows._line_parts
    row = int(np.prod(SHAPE))
    replies = [0]  # sandbox replies sent through the region (each makes its line, then its payloads)

    def payloads(self, n):
        out = honest_payloads(self, n)
        if self.shared:
            if replies[0] >= 4:
                out[0] = bytes(row * n)
            replies[0] += 1
        return out

    def parts(self, n):
        arrays, line = honest_parts(self, n)
        if not self.shared or replies[0] < 4:
            return arrays, line
        return arrays, line.replace(b'"_bin":[0,', b'"_bin":[%d,' % (row * n))

    sandbox_rows.SandboxRows.payloads = payloads
    sandbox_rows.SandboxRows._line_parts = parts
    return env


def make_sandbox_wrong_rows():
    """Its sandbox replies refer to rows of another shape than its region's."""
    from boltzlabs_gym.envside import sandbox_rows

    honest = sandbox_rows.SandboxRows._line_parts

    def parts(self, n):
        arrays, line = honest(self, n)
        if not self.shared:
            return arrays, line
        return tuple(part.replace(b"[%d,6,5,3]" % n, b"[%d,5,6,3]" % n) for part in (arrays, line))

    sandbox_rows.SandboxRows._line_parts = parts
    return TupleFrameEnv()


@pytest.mark.parametrize("direct", [True, False], ids=["lane", "worker"])
@pytest.mark.parametrize("factory", [make_sandbox_rows_and_bytes, make_sandbox_wrong_rows])
def test_a_wrong_reference_to_sandbox_rows_is_the_sandboxs_fault(factory, direct, tmp_path_factory):
    """A sandbox of several envs whose sandbox reply refers to its region's rows wrongly (and
    sends their bytes too, or another shape) broke the protocol: every env of it says so in its
    info, truncated, and its reset says so again (it lies again)."""
    pool = _pool(factory, 2, tmp_path_factory, envs_per_sandbox=2, direct=direct)
    venv = _vec(pool)
    try:
        venv.reset(seed=0)  # (before its region is in use: bytes, honest)
        _, _, terminated, truncated, info = venv.step(np.array([1, 2]))
        assert truncated.all() and not terminated.any()
        for reason in info["boltzlabs_error"]["reason"]:
            assert "broke the protocol" in reason and "region" in reason, reason
        _, info = venv.reset(seed=0)
        assert all("broke the protocol" in reason for reason in info["boltzlabs_error"]["reason"]), info
    finally:
        venv.close()


@pytest.mark.parametrize("direct", [True, False], ids=["lane", "worker"])
@pytest.mark.parametrize("factory", [make_frame_rows_then_bytes, make_tuple_rows_then_bytes])
def test_a_sandbox_that_lies_after_honest_sandbox_replies_is_caught(factory, direct, tmp_path_factory):
    """The reader checks a sandbox reply's line once and remembers it: a sandbox that answered
    plainly through its region and then sends its rows' bytes too is caught on that step all the
    same (its line is no longer the one remembered), and nothing it sent before is taken back."""
    pool = _pool(factory, 2, tmp_path_factory, envs_per_sandbox=2, direct=direct)
    venv = _vec(pool)
    try:
        venv.reset(seed=0)
        for _ in range(3):
            obs, _, terminated, truncated, info = venv.step(np.array([1, 2]))
            assert not (terminated.any() or truncated.any()) and not info, info
            frames = obs[0] if isinstance(obs, tuple) else obs
            assert frames[1].any()  # frames, not a zeroed failure's
        regions = pool._links[0].regions
        assert regions is not None and all(region.known_sandbox_line for region in regions._regions.values())
        _, _, terminated, truncated, info = venv.step(np.array([1, 2]))
        assert truncated.all() and not terminated.any()
        for reason in info["boltzlabs_error"]["reason"]:
            assert "broke the protocol" in reason and "region" in reason, reason
    finally:
        venv.close()


def _frames_region(slots: int = 2):
    """An ObsRegions with process 0's region of ``slots`` frames mapped, as a worker passes it: a
    sealed memfd (the pool's side alone, read against lines a test writes as a sandbox would)."""
    import fcntl

    from boltzlabs_gym.client.obs_regions import ObsRegions
    from boltzlabs_gym.client.results import EnvResult
    from boltzlabs_gym.wire.protocol import REGION_FDS_TAKEN

    row = int(np.prod(SHAPE))
    fd = os.memfd_create("boltzlabs-obs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    described = {"fd_index": 0, "bytes": 4096, "slots": slots, "slot_bytes": row, "dtype": "|u1", "shape": list(SHAPE)}
    regions = ObsRegions(1, envs_per_sandbox=slots)
    regions.adopt({REGION_FDS_TAKEN: [fd]}, [EnvResult(0, "ok", {"obs_region": described}, [])])
    assert 0 in regions
    return regions


def _sandbox_line(extra: bytes = b"") -> bytes:
    return (
        b'{"n":2,"obs":{"__shm__":[0,"|u1",[2,6,5,3]]},"reward":{"__nd__":[1,"<f8",[2]]},'
        b'"flags":{"__nd__":[2,"|u1",[2]]},"replies":{}' + extra + b',"_bin":[0,16,2]}\n'
    )


def test_a_sandbox_line_nested_to_the_parsers_limit_is_read_not_raised():
    """A sandbox may nest a key of its sandbox reply as deep as the parser takes; its reader then
    writes back no line it remembers, and never raises out of a step (the line is read once, as
    any other; nesting one level deeper each step finds no depth at which it would)."""
    regions = _frames_region()
    payloads = [b"", bytes(16), bytes(2)]
    for depth in range(700, 1100):
        line = _sandbox_line(b',"deep":' + b"[" * depth + b"]" * depth)
        raw, reply, out = regions.resolve(0, line, payloads)
        assert raw == line or reply is not None  # a bad reply (too deep to parse), or read
    regions.close()


def test_a_long_sandbox_line_is_read_but_not_remembered():
    """What a sandbox can make its reader keep stays small: a padded all-plain sandbox reply line is read
    as always and forgotten, by the region's reader and the sandbox reader; the same line without
    padding is remembered."""
    from boltzlabs_gym.client.results import EnvResult
    from boltzlabs_gym.client.sandbox_replies import _KNOWN_LINES, SandboxPlan, SandboxResult
    from boltzlabs_gym.wire.protocol import MAX_KNOWN_LINE_BYTES

    regions = _frames_region()
    row = int(np.prod(SHAPE))
    payloads = [b"", bytes(16), bytes(2)]
    long_line = _sandbox_line(b',"pad":"' + b"x" * MAX_KNOWN_LINE_BYTES + b'"')
    raw, reply, out = regions.resolve(0, long_line, payloads)
    assert raw is None and reply["obs"] == {"__nd__": [0, "|u1", [2, *SHAPE]]} and len(out[0]) == 2 * row
    assert regions._regions[0].known_sandbox_line is None
    regions.resolve(0, _sandbox_line(), payloads)
    assert regions._regions[0].known_sandbox_line is not None
    del out
    regions.close()
    nd_line = long_line.replace(b"__shm__", b"__nd__").replace(b'"_bin":[0,', b'"_bin":[%d,' % (2 * row))
    result = EnvResult(0, "ok", None, [bytes(2 * row), *payloads[1:]], nd_line)
    assert not isinstance(SandboxResult(SandboxPlan(0, [0, 1], [0, 1]), result, range(2)).read(), list)
    assert _KNOWN_LINES.get(nd_line, 2) is None


def test_dict_observations_in_a_sandbox_of_several_envs_go_as_bytes(tmp_path_factory, mapped):
    """Several envs per sandbox with a Dict observation that has Discrete and Text leaves: no
    region (each position's reply carries its bytes), the same results."""
    pool = _pool(make_dict_frames, N, tmp_path_factory, envs_per_sandbox=2)
    try:
        venv = _vec(pool, autoreset_mode=AutoresetMode.SAME_STEP)
        _compare_any(venv, make_dict_frames, AutoresetMode.SAME_STEP, True, N)
        _detach(venv)
        regions = pool._links[0].regions
        assert regions is not None and len(regions) == 0
        assert all("Dict/Tuple of arrays only" in why for why in regions.refused.values()), regions.refused
        assert mapped() == 0
    finally:
        pool.close()


def _patch_payload_marker(change):
    """In this env process: every reply that says its observation payloads are in the region is
    rewritten by ``change(reply, payloads)`` first."""
    from boltzlabs_gym.envside import gym_host

    honest = gym_host.GymHost._obs_payloads_to_slot

    def lying(self, reply, out):
        honest(self, reply, out)
        if "__shm__" in reply:
            change(reply, out)

    gym_host.GymHost._obs_payloads_to_slot = lying


def make_dict_wrong_count():
    _patch_payload_marker(lambda reply, out: reply.__setitem__("__shm__", [0, 2]))
    return DictFrameEnv()


def make_dict_marker_and_bytes():
    def resend(reply, out):
        out[0] = bytes(int(np.prod(SHAPE)))  # the frame's bytes on the pipe as well

    _patch_payload_marker(resend)
    return DictFrameEnv()


def make_dict_marker_without_region():
    """Refuses a region, then says its payloads are in one anyway."""
    from boltzlabs_gym.envside import gym_host

    def no_region(self, msg, payloads):
        return {"error": "no region here"}, []

    def marker(self, reply, out):
        reply["__shm__"] = [0, 3]
        out[:3] = [b"", b"", b""]

    gym_host.GymHost.obs_region = no_region
    gym_host._OTHER_OPS["obs_region"] = no_region
    gym_host.GymHost.shm_payloads = property(lambda self: memoryview(b""), lambda self, v: None)
    gym_host.GymHost._obs_payloads_to_slot = marker
    return DictFrameEnv()


def make_tuple_wrong_skeleton():
    """Describes its region with a skeleton whose references are out of order."""
    from boltzlabs_gym.envside import gym_host

    honest = gym_host.region_reply

    def lying(region, leaf, skeleton=None):
        if skeleton is not None:
            skeleton = [skeleton[1], {"count": skeleton[0]}]
        return honest(region, leaf, skeleton)

    gym_host.region_reply = lying
    return TupleFrameEnv()


def test_a_region_with_a_wrong_skeleton_is_refused(tmp_path_factory, mapped):
    """The skeleton an arrays-only observation's region is described with must refer to its
    layout's payloads in order: one that does not is refused, and observations come as bytes."""
    pool = _pool(make_tuple_wrong_skeleton, 2, tmp_path_factory)
    try:
        venv = _vec(pool, autoreset_mode=AutoresetMode.NEXT_STEP)
        _compare_any(venv, make_tuple_frames, AutoresetMode.NEXT_STEP, True, 2)
        _detach(venv)
        regions = pool._links[0].regions
        assert regions is not None and len(regions) == 0 and len(regions.refused) == 2, regions.refused
        assert mapped() == 0
    finally:
        pool.close()
