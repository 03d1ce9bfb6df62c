"""Memory snapshots, the worker's side: the launcher that swaps an env with its held fork and
forks copies from it, the held processes, and the seccomp gate that lets only those forks through.

The env's side of the same feature is :mod:`boltzlabs_gym.envside.memory_snapshot`.
"""
