"""The PostgreSQL store's group commit (wqbroker/store/postgres/group.py), with a ``run`` whose
answers the test releases by hand and a fake clock saying how long each group took: one group in
flight per key while groups are quick; on a slow link, calls start groups beside the one in
flight (so none waits a whole round trip behind another), up to the width, and only then do
they wait and go together."""

from __future__ import annotations

import asyncio

from tests.helpers import settle
from wqbroker.store.postgres.group import Grouped


class Link:
    """A ``run`` that answers each group when the test says so; ``now`` is the fake time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.groups: list[list[int]] = []
        self.answers: list[asyncio.Future[None]] = []

    async def run(self, calls: list[int], key: str) -> list[int]:
        self.groups.append(list(calls))
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.answers.append(answer)
        await answer
        return [c * 10 for c in calls]

    def answer_all(self, took: float) -> None:
        self.now += took
        for answer in self.answers:
            if not answer.done():
                answer.set_result(None)


async def _calls(grouped: Grouped[int, str, int], args: range) -> list[asyncio.Task[int]]:
    tasks = [asyncio.ensure_future(grouped.call(a, "k")) for a in args]
    await settle()
    return tasks


async def test_calls_wait_for_the_group_in_flight_while_groups_are_quick() -> None:
    link = Link()
    grouped: Grouped[int, str, int] = Grouped(link.run, width=4, slow=0.004, clock=lambda: link.now)
    first = await _calls(grouped, range(1, 2))
    rest = await _calls(grouped, range(2, 5))
    assert link.groups == [[1]]  # the others wait for it
    link.answer_all(took=0.001)
    await settle()
    assert link.groups == [[1], [2, 3, 4]]  # and then go together
    link.answer_all(took=0.001)
    assert [await t for t in first + rest] == [10, 20, 30, 40]
    assert grouped.most_in_flight == 1


async def test_on_a_slow_link_calls_go_beside_the_group_in_flight_up_to_the_width() -> None:
    link = Link()
    grouped: Grouped[int, str, int] = Grouped(link.run, width=3, slow=0.004, clock=lambda: link.now)
    warm = await _calls(grouped, range(0, 1))
    link.answer_all(took=0.040)  # a round trip to a distant database
    await settle()
    assert await warm[0] == 0
    # Now each call starts at once, beside the others, until three are in flight...
    tasks = await _calls(grouped, range(1, 6))
    assert link.groups == [[0], [1], [2], [3]]
    assert grouped.most_in_flight == 3
    # ... and the rest wait, together, for a group to end.
    link.answers[1].set_result(None)
    link.now += 0.040
    await settle()
    assert link.groups[-1] == [4, 5]
    link.answer_all(took=0.040)
    assert [await t for t in tasks] == [10, 20, 30, 40, 50]
