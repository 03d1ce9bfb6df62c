"""What both ends of a hop share: the wire protocol, codec, spaces, env pipes, channel, archives,
keys, call rules and limits.
"""
