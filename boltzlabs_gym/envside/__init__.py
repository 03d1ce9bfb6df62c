"""What runs inside a sandbox: the request loop (:mod:`.serve_loop`) both env servers run, the
Gymnasium env server (:mod:`.gym_server`), the channel's framing (:mod:`.framing`), failure
transitions (:mod:`.failures`), sandboxes of several envs (:mod:`.groups`), the process's set-up
and boltz hooks (:mod:`.process`), state blobs (:mod:`.state`), the fork server and the
memory-snapshot hooks.

Standard library only (but :mod:`.gym_server` and :mod:`.factories`, which run Gymnasium envs):
this code runs in every env process, possibly under an interpreter with nothing else installed.
"""
