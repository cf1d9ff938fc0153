#!/bin/sh
# A task handler in another language, run by `wq worker -queues archive -exec ./archive_order.sh`
# once per task: the payload's JSON on stdin ({"task": "archive_order", "kwargs": {...}}), the
# task's id and attempt in $WQ_TASK_ID and $WQ_ATTEMPT. Exit 0: done, and what it prints (JSON)
# is the task's result. Exit 100: it can never succeed (straight to the dead-letter queue, with
# the last lines of stderr as its error). Any other exit: try again later.
set -eu

payload=$(cat)
case "$payload" in
  *'"order_id"'*) ;;
  *) echo "cannot archive: no order_id in $payload" >&2; exit 100 ;;
esac

mkdir -p archive
file="archive/$WQ_TASK_ID.json"
printf '%s\n' "$payload" > "$file"
printf '{"archived": "%s", "bytes": %s, "attempt": %s}\n' \
  "$file" "$(wc -c < "$file" | tr -d ' ')" "$WQ_ATTEMPT"
