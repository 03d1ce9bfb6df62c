"""What runs inside a sandbox: the serve loops, the Gymnasium env server, framing, state blobs,
the fork server and the memory-snapshot hooks.

Standard library only (but :mod:`.gym_server` and :mod:`.factories`, which run Gymnasium envs):
this code runs in every env process, possibly under an interpreter with nothing else installed.
"""
