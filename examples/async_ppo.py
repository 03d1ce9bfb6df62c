"""Async PPO (discrete actions) in the style of EnvPool's async example, on sandboxed envs.

The envs step on their own: each ``recv()`` hands back the first ``--batch-size`` of
``--num-envs`` envs to finish, ``infos["env_id"]`` says which, and ``send(actions, env_id)``
starts their next steps while the others are still running. The rollout is a list of such
batches; advantages are computed per env by following each env id back through them.

Written for EnvPool's async mode; only the line that builds the envs differs
(``--vectorizer envpool`` runs EnvPool's own line, where it is installed)::

    python examples/async_ppo.py --total-timesteps 100000 --seed 1
    python examples/async_ppo.py --num-envs 4 --batch-size 2 --num-steps 8 --total-timesteps 128

Output: ``global_step=... mean_return_last20=... SPS=...`` lines, then a summary.
"""

import argparse
import random
import time
from collections import deque

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=100_000)
    p.add_argument("--num-envs", type=int, default=16, help="envs stepping at once")
    p.add_argument("--batch-size", type=int, default=8, help="envs per recv(): the first to finish")
    p.add_argument("--num-steps", type=int, default=64, help="recv() batches per rollout")
    p.add_argument("--learning-rate", type=float, default=2.5e-3)
    p.add_argument("--gamma", type=float, default=0.98)
    p.add_argument("--gae-lambda", type=float, default=0.8)
    p.add_argument("--num-minibatches", type=int, default=2)
    p.add_argument("--update-epochs", type=int, default=10)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.0)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--vectorizer", choices=["boltz", "envpool"], default="boltz")
    p.add_argument("--isolation", default="auto", help="sandbox isolation (boltz only)")
    return p.parse_args()


def layer_init(layer, std=2**0.5, bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()

        def mlp(out: int, std: float) -> nn.Sequential:
            return nn.Sequential(
                layer_init(nn.Linear(obs_dim, 64)),
                nn.Tanh(),
                layer_init(nn.Linear(64, 64)),
                nn.Tanh(),
                layer_init(nn.Linear(64, out), std=std),
            )

        self.critic = mlp(1, 1.0)
        self.actor = mlp(n_actions, 0.01)

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def async_gae(values, rewards, dones, env_ids, num_envs, gamma, lam):
    """GAE over a rollout of ``recv()`` batches (``[T, B]`` arrays, ``env_ids`` saying whose row).

    Row ``(t, k)`` holds env ``i``'s observation and the reward/done that came with it; the
    reward and done of the action taken there arrive with env ``i``'s *next* row. A row with no
    next row in the rollout, or whose observation ended an episode (the env resets on its next
    send and ignores the action), is masked out of the loss.
    """
    steps, batch = values.shape
    advantages = np.zeros((steps, batch), dtype=np.float32)
    mask = np.zeros((steps, batch), dtype=bool)
    next_value = np.zeros(num_envs, dtype=np.float32)
    next_adv = np.zeros(num_envs, dtype=np.float32)
    next_reward = np.zeros(num_envs, dtype=np.float32)
    next_done = np.ones(num_envs, dtype=bool)
    has_next = np.zeros(num_envs, dtype=bool)
    for t in reversed(range(steps)):
        i = env_ids[t]
        valid = has_next[i] & ~dones[t]
        nonterminal = 1.0 - next_done[i]
        delta = next_reward[i] + gamma * next_value[i] * nonterminal - values[t]
        adv = np.where(valid, delta + gamma * lam * nonterminal * next_adv[i], 0.0)
        advantages[t], mask[t] = adv, valid
        next_value[i], next_adv[i], next_reward[i], next_done[i] = values[t], adv, rewards[t], dones[t]
        has_next[i] = True
    return advantages, advantages + values, mask


def make_envs(args):
    # env setup: the one line that differs between the two
    if args.vectorizer == "boltz":
        import boltzlabs_gym

        return boltzlabs_gym.make_vec(
            args.env_id, num_envs=args.num_envs, batch_size=args.batch_size, isolation=args.isolation
        )
    import envpool

    return envpool.make(
        args.env_id, env_type="gymnasium", num_envs=args.num_envs, batch_size=args.batch_size, seed=args.seed
    )


if __name__ == "__main__":
    args = parse_args()
    rollout_size = args.num_steps * args.batch_size
    num_iterations = max(1, args.total_timesteps // rollout_size)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    envs = make_envs(args)
    obs_shape = envs.single_observation_space.shape
    agent = Agent(int(np.prod(obs_shape)), int(envs.single_action_space.n))
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    T, B = args.num_steps, args.batch_size
    obs = torch.zeros((T, B) + obs_shape)
    actions = torch.zeros((T, B), dtype=torch.long)
    logprobs = torch.zeros((T, B))
    values = np.zeros((T, B), dtype=np.float32)
    rewards = np.zeros((T, B), dtype=np.float32)
    dones = np.zeros((T, B), dtype=bool)
    env_ids = np.zeros((T, B), dtype=np.int64)

    episode_return = np.zeros(args.num_envs)
    episodic_returns = deque(maxlen=20)
    envs_seen = set()
    global_step, start_time = 0, time.time()
    envs.async_reset()  # every env starts; recv() hands them back as they finish

    for iteration in range(1, num_iterations + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

        for step in range(T):
            next_obs, reward, terminations, truncations, infos = envs.recv()
            env_id = np.asarray(infos["env_id"])
            done = np.logical_or(terminations, truncations)
            global_step += len(env_id)
            envs_seen.update(env_id.tolist())

            episode_return[env_id] += reward
            for i in env_id[done]:
                episodic_returns.append(float(episode_return[i]))
                episode_return[i] = 0.0

            next_obs = torch.as_tensor(next_obs, dtype=torch.float32)
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            envs.send(action.numpy(), env_id)  # these envs step while the next recv() waits

            obs[step], actions[step], logprobs[step] = next_obs, action, logprob
            values[step], rewards[step], dones[step], env_ids[step] = value.flatten().numpy(), reward, done, env_id

        advantages, returns, mask = async_gae(
            values, rewards, dones, env_ids, args.num_envs, args.gamma, args.gae_lambda
        )
        keep = torch.as_tensor(mask.reshape(-1))
        b_obs = obs.reshape((-1,) + obs_shape)[keep]
        b_actions = actions.reshape(-1)[keep]
        b_logprobs = logprobs.reshape(-1)[keep]
        b_advantages = torch.as_tensor(advantages.reshape(-1))[keep]
        b_returns = torch.as_tensor(returns.reshape(-1))[keep]
        b_values = torch.as_tensor(values.reshape(-1))[keep]

        n = len(b_obs)
        minibatch = max(1, n // args.num_minibatches)
        b_inds = np.arange(n)
        for _epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, n, minibatch):
                mb = b_inds[start : start + minibatch]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions[mb])
                ratio = (newlogprob - b_logprobs[mb]).exp()
                mb_adv = b_advantages[mb]
                if len(mb) > 1:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(
                    -mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                ).mean()
                newvalue = newvalue.view(-1)
                v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + args.vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

        if iteration % 20 == 0 or iteration == num_iterations:
            mean_ret = np.mean(episodic_returns) if episodic_returns else float("nan")
            sps = int(global_step / (time.time() - start_time))
            print(f"global_step={global_step} mean_return_last20={mean_ret:.1f} SPS={sps}", flush=True)

    for _ in range(args.num_envs // args.batch_size):
        envs.recv()  # collect the steps still running, so that close() drops none
    envs.close()
    print(f"vectorizer={args.vectorizer} wall_s={time.time() - start_time:.1f} episodes_seen={len(episodic_returns)}")
    print(f"envs_seen={len(envs_seen)}/{args.num_envs}")
    print(f"mean_return_last20={np.mean(episodic_returns) if episodic_returns else float('nan'):.1f}")
