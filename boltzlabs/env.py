"""Alias of :mod:`boltzlabs_gym.env` for env code written as ``from boltzlabs.env import serve``."""

from boltzlabs_gym.env import *  # noqa: F401,F403
from boltzlabs_gym.env import ENV_DIR, ENV_INDEX, WORKSPACE, measurement, serve  # noqa: F401
