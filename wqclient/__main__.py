"""``python -m wqclient``: points at the two commands."""

import sys

print("use `python -m wqclient.worker` (wq-worker) or `python -m wqclient.producer` (wq-producer)")
sys.exit(2)
