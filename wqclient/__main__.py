"""``python -m wqclient``: points at the commands."""

import sys

print(
    "use `python -m wqclient.worker` (wq-worker), `python -m wqclient.producer` (wq-producer) "
    "or `python -m wqclient.admin` (wq)"
)
sys.exit(2)
