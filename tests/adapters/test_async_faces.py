"""EnvPool's send/recv on BoltzLabsVecEnv, and the asyncio face (boltzlabs_gym.aio): exact against
SyncVectorEnv under random interleavings, failures confined to their own env."""

from __future__ import annotations

import asyncio
import os

import gymnasium as gym
import numpy as np
import pytest
from conftest import ENVS, FAULTY, ISOLATION
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import boltzlabs_gym
from boltzlabs_gym.aio import AsyncPool
from boltzlabs_gym.errors import AsyncStateError

N, BATCH = 3, 2
SANDBOXED = os.path.join(ENVS, "sandboxed")


@pytest.fixture(scope="module")
def envs():
    e = boltzlabs_gym.make_vec("CartPole-v1", num_envs=N, batch_size=BATCH, isolation=ISOLATION)
    yield e
    e.close()


def _reference(seed: int, i: int):
    ref = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")])
    obs, _ = ref.reset(seed=seed + i)
    return ref, obs[0]


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 1000), plan=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1)), min_size=6, max_size=20)
)
def test_send_recv_is_exact_against_sync_vector_env_under_any_interleaving(envs, seed, plan):
    refs = [_reference(seed, i) for i in range(N)]
    envs.async_reset(seed=seed)
    held: list[int] = []  # received, not sent again yet: the interleaving
    in_flight = N
    for hold_mask, action in plan:
        obs, rew, term, trunc, info = envs.recv()
        in_flight -= BATCH
        for k, i in enumerate(info["env_id"].tolist()):
            ref, expected = refs[i]
            np.testing.assert_array_equal(obs[k], expected)
        ids = held + info["env_id"].tolist()
        send = [i for j, i in enumerate(ids) if not hold_mask >> (j % 3) & 1]
        for i in ids:  # recv() needs batch_size envs in flight
            if in_flight + len(send) >= BATCH:
                break
            if i not in send:
                send.append(i)
        held = [i for i in ids if i not in send]
        if send:
            envs.send(np.full(len(send), action), np.array(send))
            in_flight += len(send)
            for i in send:
                ref, _ = refs[i]
                o, r, te, tr, _ = ref.step(np.array([action]))
                refs[i] = (ref, o[0])
    envs.pool.async_steps.recv()  # the rest: back to idle for the next example


def test_vec_recv_names_envs_and_refuses_what_envpool_refuses(envs):
    envs.async_reset(seed=1)
    obs, rew, term, trunc, info = envs.recv()
    assert obs.shape == (BATCH, 4) and info["env_id"].dtype == np.int32 and len(set(info["env_id"])) == BATCH
    with pytest.raises(AsyncStateError, match="is still in flight"):
        envs.send(np.zeros(1, dtype=np.int64), [int(set(range(N)).difference(info["env_id"]).pop())])
    with pytest.raises(ValueError, match="expected 2 actions"):
        envs.send(np.zeros(3, dtype=np.int64), info["env_id"])
    with pytest.raises(IndexError, match="env_id 7 out of range"):
        envs.send(np.zeros(1, dtype=np.int64), [7])
    envs.send(np.zeros(BATCH, dtype=np.int64))  # default: the last recv's envs
    envs.recv()
    with pytest.raises(ValueError, match=r"batch_size=2\), but only 1 env has a call to receive"):
        envs.recv()
    envs.pool.async_steps.recv()  # the last one: all idle again


def test_send_recv_of_every_env_at_once_is_exact_through_episode_ends():
    """batch_size=num_envs with every env sent together (the lockstep path): the same
    transitions as SyncVectorEnv (NEXT_STEP autoreset included), env ids in any order."""
    n = 2
    envs = boltzlabs_gym.make_vec("CartPole-v1", num_envs=n, batch_size=n, isolation=ISOLATION)
    ref = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(n)])
    try:
        envs.async_reset(seed=5)
        obs, *_, info = envs.recv()
        expected, _ = ref.reset(seed=5)
        np.testing.assert_array_equal(obs[np.argsort(info["env_id"])], expected)
        order = info["env_id"][::-1].copy()  # any order of every env takes the lockstep path
        episodes_ended = 0
        for t in range(30):  # a constant action ends CartPole's episodes within ~10 steps
            actions = np.array([t % 3 == 0, 1], dtype=np.int64)
            envs.send(actions[order], order)
            with pytest.raises(AsyncStateError, match="env 0 is still in flight"):
                envs.send(actions[:1], [0])
            obs, rew, term, trunc, info = envs.recv()
            r_obs, r_rew, r_term, r_trunc, _ = ref.step(actions)
            assert info["env_id"].tolist() == [0, 1] and info["env_id"].dtype == np.int32
            np.testing.assert_array_equal(obs, r_obs)
            np.testing.assert_array_equal(rew, r_rew)
            np.testing.assert_array_equal(term, r_term)
            np.testing.assert_array_equal(trunc, r_trunc)
            episodes_ended += int(r_term.sum())
            order = info["env_id"]
        assert episodes_ended >= 2
    finally:
        envs.close()
        ref.close()


def test_reset_mask_all_false_uses_gymnasiums_words(envs):
    with pytest.raises(ValueError, match=r"must contain a boolean array with at least one True value"):
        envs.reset(options={"reset_mask": np.zeros(N, dtype=bool)})


async def _cancel_mid_step(face: AsyncPool, action, after: float) -> None:
    """Cancel a coroutine ``after`` seconds into its step of ``action`` on an env it took."""

    async def cancelled():
        async with face.env() as env:
            await env.reset(seed=0)
            await env.step(action)

    task = asyncio.ensure_future(cancelled())
    await asyncio.sleep(after)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_asyncio_coroutines_share_envs_and_failures_stay_their_own():
    async def main():
        async with AsyncPool(FAULTY, n=2, isolation=ISOLATION, step_timeout=1.0, acquire_timeout=20) as pool:

            async def rollout(action):
                async with pool.env() as env:
                    await env.reset(seed=0)
                    return await env.step(action)

            results = await asyncio.gather(*(rollout(a) for a in [1, {"crash": True}, 2, 3, 4, 5]))
            rewards = [r[1] for r in results]
            assert rewards[0] == 1 and rewards[2:] == [2, 3, 4, 5]  # only the crashing one failed
            assert results[1][3] and "boltzlabs_error" in results[1][4]

            await _cancel_mid_step(pool, {"sleep": 0.3}, after=0.1)
            # The env comes back after its step finished and a reset: both envs can be taken.
            async with pool.env() as a, pool.env() as b:
                assert {a.env_id, b.env_id} == {0, 1}
                with pytest.raises(AsyncStateError, match="reset\\(\\) it before step"):
                    await a.step(1)
                pool.acquire_timeout = 0.1
                with pytest.raises(TimeoutError, match="all 2 are held"):
                    async with pool.env():
                        pass

    asyncio.run(main())


def test_asyncio_cancel_on_a_sandbox_of_two_envs_and_close_leaves_the_pool_idle():
    """A step cancelled on a sandbox holding K=2 envs (a hung one, killed at its deadline): the
    env comes back after that step and a reset; a mid-episode release goes back as it is; closing
    the face leaves nothing in flight on the pool it was given."""
    with boltzlabs_gym.RLPool(SANDBOXED, n=2, envs_per_sandbox=2, isolation=ISOLATION, step_timeout=1.0) as pool:

        async def main():
            async with AsyncPool(pool, acquire_timeout=20) as face:
                await _cancel_mid_step(face, "hang", after=0.2)
                # Both envs of the sandbox, once the cancelled one is back; called together, they
                # go out as one call to their sandbox.
                async with face.env() as a, face.env() as b:
                    await asyncio.gather(a.reset(seed=1), b.reset(seed=2))
                    steps = await asyncio.gather(a.step(3), b.step(4))
                    assert [s[1] for s in steps] == [3, 4] and not any(s[3] for s in steps)
                async with face.env() as a, face.env() as b:  # released mid-episode: reset first
                    with pytest.raises(AsyncStateError, match="reset\\(\\) it before step"):
                        await a.step(1)
                    await asyncio.gather(a.reset(seed=3), b.reset(seed=4))
                    await asyncio.gather(a.step(1), b.step(1))

        asyncio.run(main())
        assert not pool.async_steps.in_flight and not pool.async_steps.finished
        pool.reset(seed=0)  # a lockstep call: nothing of the face's is left in flight
        _, rewards, _, _ = pool.step([1, 2])
        assert rewards.tolist() == [1, 2]


def test_asyncio_over_a_vector_env_decodes_into_its_spaces(envs):
    async def main():
        async with AsyncPool(envs, hold_warning=0.2) as pool:
            async with pool.env() as env:
                obs, _ = await env.reset(seed=3)
                assert isinstance(obs, np.ndarray) and obs.shape == (4,)
                obs, reward, *_ = await env.step(1)
                assert reward == 1.0
                with pytest.warns(ResourceWarning, match="held by one coroutine"):
                    await asyncio.sleep(0.3)
                    await env.step(1)
                    await asyncio.sleep(0.6)

    asyncio.run(main())


@pytest.fixture(scope="module", params=[2, 4], ids=["K=2", "K=4"])
def sandboxed_envs(request):
    k = request.param
    e = boltzlabs_gym.make_vec("CartPole-v1", num_envs=2 * k, envs_per_sandbox=k, isolation=ISOLATION)
    yield e
    e.close()


async def _rollout_against_reference(face: AsyncPool, seed: int, plan: list[tuple[int, int]]) -> int:
    """Take an env, reset it with ``seed``, step it with ``plan``'s actions (each after yielding
    to the loop a few times: a tick of its own), checking every transition against a
    SyncVectorEnv's; the steps it took."""
    ref, expected = _reference(seed, 0)
    try:
        async with face.env() as env:
            obs, _ = await env.reset(seed=seed)
            np.testing.assert_array_equal(obs, expected)
            for t, (action, ticks) in enumerate(plan):
                for _ in range(ticks):
                    await asyncio.sleep(0)
                obs, reward, terminated, truncated, _ = await env.step(action)
                r_obs, r_rew, r_term, r_trunc, _ = ref.step(np.array([action]))
                np.testing.assert_array_equal(obs, r_obs[0])
                assert (reward, terminated, truncated) == (r_rew[0], r_term[0], r_trunc[0])
                if terminated or truncated:
                    return t + 1
        return len(plan)
    finally:
        ref.close()


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    rollouts=st.lists(
        st.tuples(
            st.integers(0, 1000), st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3)), min_size=1, max_size=10)
        ),
        min_size=12,
        max_size=24,
    )
)
def test_asyncio_neighbours_of_a_sandbox_wait_their_turn_and_stay_exact(sandboxed_envs, rollouts):
    """More coroutines than envs, each stepping its env in ticks of its own: a call to an env whose
    sandbox neighbour is in flight waits for it (no AsyncStateError), and every trajectory is
    SyncVectorEnv's for the same seed and actions."""

    async def main():
        async with AsyncPool(sandboxed_envs, acquire_timeout=60) as face:
            steps = await asyncio.gather(*(_rollout_against_reference(face, s, p) for s, p in rollouts))
            assert all(n >= 1 for n in steps)
            assert not face._calls._turns or not any(face._calls._turns.values())

    asyncio.run(main())
    assert not sandboxed_envs.pool.async_steps.in_flight


def test_asyncio_a_call_behind_a_slow_neighbour_goes_out_when_the_sandbox_is_free():
    """Env 1's reset, made while its sandbox neighbour env 0 is in a slow reset, waits for it and
    then runs; a call cancelled while waiting never goes out, and its env comes back at once."""
    with boltzlabs_gym.RLPool(SANDBOXED, n=2, envs_per_sandbox=2, isolation=ISOLATION, step_timeout=5.0) as pool:

        async def main():
            async with AsyncPool(pool, acquire_timeout=20) as face:
                async with face.env() as a, face.env() as b:
                    slow = asyncio.ensure_future(a.reset(seed=1, options={"sleep": 0.3}))
                    await asyncio.sleep(0.05)  # env 0's reset is out: its sandbox is busy
                    obs, _ = await b.reset(seed=2)
                    assert slow.done() and obs == {"env": b.env_id, "t": 0, "seed": 2, "pid": obs["pid"]}
                    slow_obs, _ = slow.result()
                    assert slow_obs["seed"] == 1 and slow_obs["pid"] == obs["pid"]
                    assert [s[1] for s in await asyncio.gather(a.step(3), b.step(4))] == [3, 4]

                    slow = asyncio.ensure_future(a.reset(seed=5, options={"sleep": 0.3}))
                    await asyncio.sleep(0.05)
                    waiting = asyncio.ensure_future(b.step(7))
                    await asyncio.sleep(0.05)
                    assert face._calls._turns[0]  # b's step waits for a's reset
                    waiting.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await waiting
                    assert not face._calls._turns[0] and face._calls.pending(b.env_id) is None
                    await slow
                    obs, *_ = await b.step(1)
                    assert obs["t"] == 2  # from 1: the cancelled step never ran

        asyncio.run(main())
        assert not pool.async_steps.in_flight and not pool.async_steps.finished
