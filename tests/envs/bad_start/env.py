"""Fails at import, before serving: the pool must name this env and show this stderr."""

import sys

from boltzlabs_gym.env import ENV_INDEX

if ENV_INDEX == 2:
    sys.stderr.write("bad_start: cannot load the simulator for env 2\n")
    raise SystemExit(3)

from boltzlabs_gym.env import serve  # noqa: E402

serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
