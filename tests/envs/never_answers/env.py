"""Never answers its first reset: it neither calls serve() nor exits."""

import sys
import time

sys.stderr.write("never_answers: sleeping instead of serving\n")
sys.stderr.flush()
time.sleep(3600)
