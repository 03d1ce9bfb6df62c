"""Written against the hosted service's import name: must run unchanged."""

from boltzlabs.env import serve

serve(reset=lambda seed: {"hello": seed}, step=lambda a: ({"echo": a}, 0.5, True, {"via": "boltzlabs"}))
