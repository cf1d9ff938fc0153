"""The PostgreSQL store's SQL, read from the files in ``sql/`` when the package loads.

``sql/functions.sql`` holds the PL/pgSQL functions (made again whole by every migration: see
schema.py); ``sql/queries.sql`` every statement the store runs, each under ``-- name: NAME``, read
into :data:`Q`, a :class:`Queries` (one field per name: a statement missing from the file, or one
the class does not list, stops the import, so a typo cannot wait for its first call). Nothing is
ever formatted into these texts: what varies is a parameter (``$1`` ...), and the schema is ``wq``.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from typing import Final

_MARK: Final = "-- name: "


@dataclasses.dataclass(frozen=True, slots=True)
class Queries:
    """The statements of ``sql/queries.sql``, by name (the file says what each does)."""

    enqueue: str
    id_blocks: str
    skip_ids: str
    claim: str
    settle: str
    settle_claim: str
    extend: str
    cancel: str
    empty: str
    delete_queue: str
    release: str
    expired: str
    sweep: str
    fold: str
    requeue: str
    purge: str
    pause: str
    set_limits: str
    put_schedule: str
    get_schedule: str
    list_schedules: str
    schedule_count: str
    delete_schedule: str
    pause_schedule: str
    due_schedules: str
    fire: str
    skip_schedule: str
    stats: str
    queue_stats: str
    queues: str
    report: str
    lookup: str
    watch: str
    children: str
    dead: str
    list_ready: str
    list_delayed: str
    list_handed_out: str
    list_dead: str
    list_waiting: str
    list_succeeded: str
    held: str
    queue_names: str
    db_now: str
    ready_left: str
    announce: str
    ping: str
    try_lock: str
    unlock: str
    vacuum_tasks: str
    vacuum_counters: str
    vacuum_keys: str
    vacuum_edges: str
    lock: str
    no_deadline: str
    has_meta: str
    version: str
    other_tables: str
    record_version: str
    new_id_key: str
    id_key: str
    wipe: str
    check: str
    edges_check: str


def read(name: str) -> str:
    """A file of ``sql/``, as text."""
    return resources.files(__package__).joinpath("sql", name).read_text("utf-8")


def parse(text: str) -> dict[str, str]:
    """The named statements of a file: each ``-- name: NAME`` line starts one, which runs to the
    next (its lines that are only a comment left out)."""
    found: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(_MARK):
            name = line.removeprefix(_MARK).strip()
            if name in found:
                raise RuntimeError(f"sql/queries.sql names {name!r} twice")
            lines = found[name] = []
        elif lines is not None and not line.lstrip().startswith("--"):
            lines.append(line)
    return {name: "\n".join(lines).strip() for name, lines in found.items()}


def _queries() -> Queries:
    found = parse(read("queries.sql"))
    wanted = {f.name for f in dataclasses.fields(Queries)}
    if found.keys() != wanted:
        raise RuntimeError(
            f"sql/queries.sql: missing {sorted(wanted - found.keys())}, "
            f"unknown {sorted(found.keys() - wanted)}"
        )
    return Queries(**found)


Q: Final = _queries()
FUNCTIONS: Final = read("functions.sql")
