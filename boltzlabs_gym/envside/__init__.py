"""What runs inside a sandbox: the two env hosts, the JSON env host behind
:func:`boltzlabs_gym.env.serve` (:mod:`.json_host`) and the Gymnasium env host (:mod:`.gym_host`,
its loops :mod:`.gym_loops` and start-up :mod:`.gym_start`), the request loop both run
(:mod:`.serve_loop`), the channel's framing (:mod:`.framing`), failure transitions
(:mod:`.failures`), sandboxes of several envs (:mod:`.sandbox_slots`, :mod:`.sandbox_rows`), the process's
set-up and boltz hooks (:mod:`.process`), state blobs (:mod:`.state`), the fork server and the
memory-snapshot hooks.

Standard library only (but the Gymnasium env host and :mod:`.factories`, which run Gymnasium envs):
this code runs in every env process, possibly under an interpreter with nothing else installed.
Nothing here runs in the trainer: the trainer writes a factory env directory with
:mod:`boltzlabs_gym.vector.factory_env_dir`.
"""
