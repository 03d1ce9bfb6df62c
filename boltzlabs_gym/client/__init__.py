"""The trainer's side: :class:`~boltzlabs_gym.RLPool`, its routes to the envs, its links to workers,
start-up, the direct lane, grouping, results, snapshots, worker sources, stats and timing.

Nothing here imports :mod:`boltzlabs_gym.worker`: a pool reaches its workers only over the wire.
"""
