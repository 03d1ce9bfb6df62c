"""Fails at import, before serving (in boltz mode: in the template)."""

import sys

sys.stderr.write("boltz_bad_import: cannot load the simulator\n")
raise SystemExit(3)
