"""The trainer's side: :class:`~boltzlabs_gym.RLPool`, its settings
(:class:`~boltzlabs_gym.client.options.PoolOptions`), and the parts it owns: its batched calls
(``batch_calls``), its routes to the envs (``routes``, ``sandbox_route`` for several envs per
sandbox), its links to workers, start-up, the direct lane, sandbox_replies, results, its snapshots
(``snapshot_keeper``, the ``snapshot`` handle), worker sources, the checks of its arguments,
stats and timing.

Nothing here imports :mod:`boltzlabs_gym.worker`: a pool reaches its workers only over the wire.
"""
