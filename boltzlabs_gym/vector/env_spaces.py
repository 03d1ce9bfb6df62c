"""The vector env's spaces: every env's, as its ``describe`` reply announces them, checked and
batched as ``SyncVectorEnv`` checks and batches its envs' spaces."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import gymnasium as gym
import numpy as np
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector.utils import batch_differing_spaces, batch_space, create_empty_array, iterate

from ..client.pool import OK, RLPool
from ..errors import EnvStartError
from ..wire.spaces import JsonSpace, seed_space_from_json, space_from_json
from .gym_errors import SubEnvSpaceError

__all__ = ["EnvSpaces", "describe_envs", "env_spaces", "zero_observation"]


class EnvSpaces(NamedTuple):
    """A vector env's spaces: single and batched, and each env's own observation space."""

    single_action_space: gym.Space
    action_space: gym.Space
    single_observation_space: gym.Space
    observation_space: gym.Space
    #: Every env's observation space; envs that announce env 0's space share its object.
    obs_spaces: list


def describe_envs(pool: RLPool) -> list[dict]:
    """Every env's ``describe`` reply, in one batched call."""
    replies = []
    for r in pool.call_envs({"op": "describe"}):
        reply = cast(dict, r.reply)  # call_envs parses every reply (it is not raw)
        if r.status != OK or "error" in reply:
            raise EnvStartError(
                f"env {r.index} could not describe itself: {reply}",
                index=r.index,
                stderr_tail=str(reply.get("stderr", "")),
            )
        replies.append(reply)
    return replies


def env_spaces(described: list[dict], observation_mode: Any, num_envs: int) -> EnvSpaces:
    """The spaces of envs that ``described`` themselves so, as ``SyncVectorEnv`` chooses them for
    ``observation_mode``; envs whose spaces do not fit together are refused (SubEnvSpaceError)."""
    d = described[0]
    obs_spaces = _spaces_of(described, "observation_space")
    action_spaces = _spaces_of(described, "action_space")
    # As SyncVectorEnv batches env 0's own spaces (batch_space copies their generators), the
    # batched spaces sample what env 0's would: a seed its factory gave them carries over.
    seed_space_from_json(obs_spaces[0], d.get("observation_space_rng"))
    seed_space_from_json(action_spaces[0], d.get("action_space_rng"))
    single_action = action_spaces[0]
    action_space = batch_space(single_action, num_envs)
    observation_space, single_obs = _observation_spaces(observation_mode, obs_spaces, num_envs)
    _check_env_spaces(observation_mode, single_obs, single_action, obs_spaces, action_spaces)
    return EnvSpaces(single_action, action_space, single_obs, observation_space, obs_spaces)


def _observation_spaces(observation_mode: Any, obs_spaces: list, num_envs: int) -> tuple[gym.Space, gym.Space]:
    """``(observation_space, single_observation_space)`` as ``SyncVectorEnv`` chooses them."""
    if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
        if not isinstance(observation_mode[0], gym.Space) or not isinstance(observation_mode[1], gym.Space):
            raise TypeError(
                f"Expected both elements of observation_mode to be Spaces, got "
                f"{type(observation_mode[0])} and {type(observation_mode[1])}"
            )
        return observation_mode
    if observation_mode == "same":
        return batch_space(obs_spaces[0], num_envs), obs_spaces[0]
    if observation_mode == "different":
        return batch_differing_spaces(obs_spaces), obs_spaces[0]
    raise ValueError(
        "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and "
        f"batch observation space, actual got {observation_mode}"
    )


def zero_observation(space: gym.Space) -> Any:
    """The observation a failed env's slot holds: zeros of the space (None for JSON values)."""
    if isinstance(space, JsonSpace):
        return None
    return next(iter(iterate(batch_space(space, 1), create_empty_array(space, 1, np.zeros))))


def _spaces_of(described: list[dict], key: str) -> list:
    """Every env's space ``key``, rebuilt once per distinct JSON form (envs that announce
    env 0's space share its object)."""
    first_json = described[0].get(key)
    first = space_from_json(first_json)
    return [first if d.get(key) == first_json else space_from_json(d.get(key)) for d in described]


def _check_env_spaces(
    observation_mode: Any, single_obs: gym.Space, single_action: gym.Space, obs_spaces: list, action_spaces: list
) -> None:
    """Refuse envs whose spaces differ, as ``SyncVectorEnv`` does (same rules, same words)."""
    for i, (obs_space, action_space) in enumerate(zip(obs_spaces, action_spaces)):
        if observation_mode == "same":
            if obs_space != single_obs:
                raise SubEnvSpaceError(
                    "BoltzLabsVecEnv(..., observation_mode='same') however the sub-environments observation spaces "
                    f"are not equivalent. single_observation_space={single_obs}, sub-environment {i} "
                    f"observation_space={obs_space}. "
                    "If this is intentional, use `observation_mode='different'` instead."
                )
        elif not is_space_dtype_shape_equiv(obs_space, single_obs):
            raise SubEnvSpaceError(
                "BoltzLabsVecEnv(..., observation_mode='different' or custom space) however the sub-environments "
                f"observation spaces do not share a common shape and dtype, single_observation_space={single_obs}, "
                f"sub-environment {i} observation space={obs_space}"
            )
        if action_space != single_action:
            raise SubEnvSpaceError(
                f"Sub-environment {i}'s action space doesn't make the `single_action_space`, "
                f"action_space={action_space}, single_action_space={single_action}"
            )
