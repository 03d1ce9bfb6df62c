"""Compatibility name for env directories written against the hosted service.

``from boltzlabs.env import serve`` is the same function as
``from boltzlabs_gym.env import serve``.
"""
