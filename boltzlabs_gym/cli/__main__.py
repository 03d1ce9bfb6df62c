"""``python -m boltzlabs_gym.cli``: the ``boltzlabs-gym`` command."""

import sys

from . import main

sys.exit(main())
