"""Never answers its first reset (hangs at start-up)."""

import time

while True:
    time.sleep(1)
