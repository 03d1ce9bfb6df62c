"""The worker side: the ROUTER server, env processes, isolation backends, memory accounting.

Nothing here imports the client or the adapters; dependencies point one way.
"""
