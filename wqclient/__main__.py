"""``python -m wqclient``: points at the commands."""

import sys

print(
    "use `python -m wqclient.cli.worker` (wq-worker), `python -m wqclient.cli.producer` "
    "(wq-producer) or `python -m wqclient.cli.admin` (wq)"
)
sys.exit(2)
