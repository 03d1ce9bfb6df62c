"""The hosted service's name for the env side, kept on purpose: not a shim to be removed.

Env directories written for the hosted BoltzLabs service import ``from boltzlabs.env import
serve`` (``tests/envs/hello`` is one), and they run unchanged on this library:
:mod:`boltzlabs.env` is :mod:`boltzlabs_gym.env` under that name, the same objects. It is the
only module here; everything else lives in :mod:`boltzlabs_gym`.
"""
