"""Memory snapshots, the worker's side: taking and restoring them (:mod:`.snapshotter`, a part of
the worker), the launcher that swaps an env with its held fork and forks copies from it
(:mod:`.launcher`), the held processes (:mod:`.holders`), and the seccomp gate that lets only
those forks through (:mod:`.gate`).

The env's side of the same feature is :mod:`boltzlabs_gym.envside.memory_snapshot`.
"""
