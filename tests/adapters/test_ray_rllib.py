"""RLlib builds its env runners' vector envs with ``gym.make_vec``: our registered
``vector_entry_point`` puts a sandboxed BoltzLabsVecEnv inside RLlib with no RLlib code of ours."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "boltzlabs-gym[ray]")')
pytest.importorskip("ray.rllib", reason='RLlib is not installed (pip install "ray[rllib]"); it pins gymnasium==1.2.2')

from conftest import ISOLATION  # noqa: E402


@pytest.mark.slow
def test_rllib_ppo_steps_cartpole_in_our_sandboxes():
    from ray.rllib.algorithms.ppo import PPOConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    algo = None
    try:
        config = (
            PPOConfig()
            .environment("boltzlabs_gym:BoltzLabsCartPole-v0", env_config={"isolation": ISOLATION})
            .env_runners(
                num_env_runners=1,
                num_envs_per_env_runner=4,
                gym_env_vectorize_mode="vector_entry_point",
                rollout_fragment_length=64,
            )
            .training(train_batch_size_per_learner=256, minibatch_size=64, num_epochs=1)
        )
        t0 = time.monotonic()
        algo = config.build_algo()
        steps = [algo.train()["env_runners"]["num_env_steps_sampled_lifetime"] for _ in range(2)]
        assert steps[1] > steps[0] >= 256
        (seen,) = algo.env_runner_group.foreach_env_runner(
            lambda runner: (
                type(runner.env.unwrapped).__name__,
                runner.env.unwrapped.num_envs,
                runner.env.unwrapped.isolation.backend,
                runner.env.unwrapped.pool.workers,
            ),
            local_env_runner=False,
        )
        name, num_envs, backend, workers = seen
        assert name == "BoltzLabsVecEnv" and num_envs == 4
        if ISOLATION == "auto":
            assert backend in ("namespaces", "bwrap", "process")
        assert workers and workers[0].startswith("ipc://")  # the env runner's own local worker
        assert time.monotonic() - t0 < 90
    finally:
        if algo is not None:
            algo.stop()
        ray.shutdown()
