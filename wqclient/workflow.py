"""Workflows: tasks that run after others, built on the broker's ``after`` (docs/design/results.md).

A workflow is made of **signatures**, a task's payload and its enqueue options, not yet sent::

    from wqclient import Client, chain, chord, group, signature

    with Client("http://localhost:8080") as wq:
        # Each runs once the one before has succeeded; its delivery carries that one's result.
        flow = chain(signature({"op": "fetch", "url": u}), {"op": "parse"}, {"op": "store"})
        print(flow.submit(wq).result(timeout=60))     # the last one's result

        # In parallel, then one callback that runs once all of them have succeeded.
        tally = chord([{"op": "count", "shard": n} for n in range(8)], {"op": "sum"})
        print(tally.submit(wq).result(timeout=60))

- :func:`chain` ``(a, b, c)``: ``b`` waits for ``a``, ``c`` for ``b``; each step is handed its
  predecessor's result (``task.parents[0].result`` in a Worker's handler, whose return value is
  the step's result).
- :func:`group` ``([a, b, c])``: side by side, none waiting for another; its result is the list of
  theirs, in order.
- :func:`chord` ``(group, callback)``: the callback waits for every member of the group and is
  handed all their results, in order (``[p.result for p in task.parents]``).

They nest: a chain's step may be a group (the next step waits for all of it) or a chain, a group's
member a chain, and so on. A step that is not a signature (a dict, a number ...) is the payload of
one with no options; to give a list as a payload, wrap it: ``signature([1, 2])``.

``submit(client)`` enqueues the whole workflow in **one** ``enqueue_many`` call (all or none: the
items name the earlier ones they wait for by index) and returns a handle. With a blocking
:class:`~wqclient.Client` the handle's ``result(timeout)`` blocks; with an
:class:`~wqclient.AsyncClient`, ``await wf.submit(client)`` gives a handle whose ``result`` is
awaited. ``result`` waits through the broker's result wait (GET /jobs/{id}/result, gRPC
WaitResult) and returns the decoded result, or raises :class:`~wqclient.TaskNotSucceeded` (the
task is dead, say because a step before it failed, or was cancelled or expired),
:class:`~wqclient.ResultTimeout` (still pending when the timeout ran out) or
:class:`~wqclient.NotFound` (its result is gone: its TTL ran out, or it was acked without one
before the wait began: a handler that returns None keeps no result).

Everything here goes through the public client API: any language can build the same graphs with
``after`` over HTTP or gRPC. :class:`Signature` is the unit a task framework produces (an
``@app.task``'s ``.s(...)``): a payload and options, enqueued as one :class:`~wqclient.EnqueueItem`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeAlias, TypeVar, overload

from wqclient.client import AsyncClient, Client, after_refs, encode_payload
from wqclient.errors import InvalidArgument, ResultTimeout, TaskNotSucceeded
from wqclient.models import Enqueued, EnqueueItem, Task, TaskResult

#: What turns a task's result, decoded from JSON, into the value its function's return hint
#: says (wqclient.codec; a task function's handles and signatures carry one).
Decode: TypeAlias = Callable[[Any], Any]

# -- the shapes ------------------------------------------------------------------------------------

H = TypeVar("H")  # the handle a blocking client's submit() returns
AH = TypeVar("AH")  # an asyncio client's


class Workflow(Generic[H, AH]):
    """What :func:`chain`, :func:`group`, :func:`chord` and :class:`Signature` have in common:
    they can be submitted, each as one batch."""

    __slots__ = ()

    def _build(self, items: list[EnqueueItem], after: tuple[int, ...]) -> tuple[_Shape, list[int]]:
        """Append this workflow's tasks to ``items``, its first ones waiting for the items
        ``after`` (indices); its shape, and the indices of its last tasks (those a step after
        it waits for)."""
        raise NotImplementedError

    def items(self) -> list[EnqueueItem]:
        """The batch :meth:`submit` enqueues: one item per task, in order, each waiting for the
        earlier ones it names by index."""
        items: list[EnqueueItem] = []
        self._build(items, ())
        return items

    @overload
    def submit(self, client: Client) -> H: ...

    @overload
    def submit(self, client: AsyncClient) -> Coroutine[Any, Any, AH]: ...

    def submit(self, client: Client | AsyncClient) -> H | Coroutine[Any, Any, AH]:
        """Enqueue every task of the workflow in one batch (all or none) and return its handle:
        with a :class:`~wqclient.Client`, at once; with an :class:`~wqclient.AsyncClient`, to
        be awaited (``handle = await flow.submit(client)``)."""
        items: list[EnqueueItem] = []
        shape, _ = self._build(items, ())
        if isinstance(client, AsyncClient):
            return self._submit_async(client, items, shape)
        if not isinstance(client, Client):
            raise InvalidArgument(
                f"submit() takes a wqclient Client or AsyncClient, got {type(client).__name__}"
            )
        ids = client.enqueue_many(items)
        handle: H = _handle(shape, ids, client, self._decoders())
        return handle

    async def _submit_async(
        self, client: AsyncClient, items: list[EnqueueItem], shape: _Shape
    ) -> AH:
        ids = await client.enqueue_many(items)
        handle: AH = _async_handle(shape, ids, client, self._decoders())
        return handle

    def _leaves(self) -> Iterator[Signature]:
        """Its signatures, in the order :meth:`_build` makes their items."""
        raise NotImplementedError

    def _decoders(self) -> list[Decode | None]:
        """Each item's result decoder (a task function's signature has one), in order."""
        return [leaf.decode for leaf in self._leaves()]


@dataclass(frozen=True, slots=True)
class _Group:
    members: tuple[_Shape, ...]


@dataclass(frozen=True, slots=True)
class _Chain:
    steps: tuple[_Shape, ...]


_Shape: TypeAlias = "int | _Group | _Chain"  # an item's index, or how handles nest


@dataclass(frozen=True, slots=True)
class Signature(Workflow["TaskHandle", "AsyncTaskHandle"]):
    """One task, not yet sent: its payload (any JSON value, or ``bytes`` of JSON text) and the
    options of :meth:`AsyncClient.enqueue <wqclient.AsyncClient.enqueue>` (None: the broker's
    default). ``after``: tasks outside the workflow it waits for too (ids or handles), beside
    those the workflow makes it wait for. Reusable: it can be submitted, or put in workflows,
    any number of times; :meth:`set` makes a copy with other options."""

    payload: Any
    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    delay_ms: int | None = None
    result_ttl_ms: int | None = None
    expires_in_ms: int | None = None
    timeout_ms: int | None = None
    idempotency_key: str | None = None
    after: Sequence[Any] | None = None
    unique: bool = False  # (with idempotency_key: one live task per key, see enqueue's unique)
    # The result's decoder, for a task function's signature (``.s()``): its handle's result()
    # is then the value the function's return hint says. Not part of what is sent.
    decode: Decode | None = field(default=None, compare=False, repr=False)

    def set(self, **options: Any) -> Signature:
        """A copy with these options changed (``sig.set(queue="slow", priority=9)``)."""
        return replace(self, **options)

    def item(self, after: Sequence[str | int] = ()) -> EnqueueItem:
        """The task as a batch's item, waiting for ``after`` (task ids, or indices of earlier
        items of the batch) as well as its own ``after``."""
        own = after_refs(self.after, "after") or ()
        waits = (*after, *own)
        return EnqueueItem(
            encode_payload(self.payload),
            self.max_attempts,
            self.delay_ms,
            self.queue,
            self.priority,
            self.idempotency_key,
            self.expires_in_ms,
            self.timeout_ms,
            self.unique,
            waits or None,
            self.result_ttl_ms,
        )

    def _build(self, items: list[EnqueueItem], after: tuple[int, ...]) -> tuple[_Shape, list[int]]:
        index = len(items)
        items.append(self.item(after))
        return index, [index]

    def _leaves(self) -> Iterator[Signature]:
        yield self


def signature(payload: Any, **options: Any) -> Signature:
    """A task, not yet sent: ``payload`` and the enqueue options (``queue``, ``priority``,
    ``max_attempts``, ``delay_ms``, ``result_ttl_ms``, ``expires_in_ms``, ``timeout_ms``,
    ``idempotency_key``, ``after``)."""
    return Signature(payload, **options)


# A step of a workflow as given: a workflow, or the payload of a task with no options.
Step: TypeAlias = Workflow[Any, Any] | Any


def _node(step: Step) -> Workflow[Any, Any]:
    return step if isinstance(step, Workflow) else Signature(step)


class Group(Workflow["GroupHandle", "AsyncGroupHandle"]):
    """Tasks (or workflows) side by side: see :func:`group`."""

    __slots__ = ("members",)

    def __init__(self, members: Iterable[Step]) -> None:
        self.members: tuple[Workflow[Any, Any], ...] = tuple(_node(m) for m in members)
        if not self.members:
            raise InvalidArgument("a group needs at least one task")

    def __repr__(self) -> str:
        return f"group({', '.join(map(repr, self.members))})"

    def _build(self, items: list[EnqueueItem], after: tuple[int, ...]) -> tuple[_Shape, list[int]]:
        shapes: list[_Shape] = []
        leaves: list[int] = []
        for member in self.members:
            shape, last = member._build(items, after)
            shapes.append(shape)
            leaves.extend(last)
        return _Group(tuple(shapes)), leaves

    def _leaves(self) -> Iterator[Signature]:
        for member in self.members:
            yield from member._leaves()


class Chain(Workflow["ChainHandle", "AsyncChainHandle"]):
    """Steps one after the other: see :func:`chain` (and :func:`chord`, a chain of a group and
    its callback)."""

    __slots__ = ("steps",)

    def __init__(self, steps: Iterable[Step]) -> None:
        self.steps: tuple[Workflow[Any, Any], ...] = tuple(_node(s) for s in steps)
        if not self.steps:
            raise InvalidArgument("a chain needs at least one task")

    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.steps))})"

    def _build(self, items: list[EnqueueItem], after: tuple[int, ...]) -> tuple[_Shape, list[int]]:
        shapes: list[_Shape] = []
        leaves = list(after)
        for step in self.steps:
            shape, leaves = step._build(items, tuple(leaves))
            shapes.append(shape)
        return _Chain(tuple(shapes)), leaves

    def _leaves(self) -> Iterator[Signature]:
        for step in self.steps:
            yield from step._leaves()


def chain(*steps: Step) -> Chain:
    """Steps that run one after the other: each waits until the one before has succeeded (all
    of it, for a group) and is handed its result in ``task.parents``. A step that fails for
    good buries the steps after it (dead, their last error naming it). The handle's
    ``result()`` is the last step's."""
    return Chain(steps)


def group(*tasks: Step | Iterable[Step]) -> Group:
    """Tasks (or workflows) that run side by side: ``group([a, b, c])`` or ``group(a, b, c)``.
    The handle's ``result()`` is the list of their results, in order."""
    if len(tasks) == 1:
        only: Any = tasks[0]
        if isinstance(only, (list, tuple)) or (
            hasattr(only, "__next__") and not isinstance(only, Workflow)
        ):  # (a list of tasks, or an iterator of them: a generator expression)
            return Group(only)
    return Group(tasks)


def chord(header: Group | Iterable[Step], callback: Step) -> Chain:
    """A group, then one callback that runs once every member has succeeded, handed all their
    results in order (``[p.result for p in task.parents]``); if one fails for good, the
    callback is buried instead. Celery's chord: ``chain(group(header), callback)``, whose
    handle's ``steps`` are the group's handle and the callback's, and whose ``result()`` is the
    callback's."""
    return Chain((header if isinstance(header, Group) else Group(header), callback))


# -- handles -------------------------------------------------------------------------------------


def _value(
    task_id: str, answer: TaskResult | None, timeout: float | None, decode: Decode | None = None
) -> Any:
    """A result wait's answer as a handle's ``result()`` gives it (``decode``: the task
    function's result decoder, if it has one)."""
    if answer is None:
        after = "" if timeout is None else f" after {timeout:g} s"
        raise ResultTimeout(f"task {task_id} is still pending{after}", task_id=task_id)
    if answer.succeeded:
        if decode is None or answer.result_json is None:
            return answer.result
        return decode(answer.result)
    why = {"dead": "is dead", "cancelled": "was cancelled", "expired": "expired"}.get(
        answer.state, answer.state
    )
    message = f"task {task_id} {why}" + (f": {answer.last_error}" if answer.last_error else "")
    raise TaskNotSucceeded(
        message, task_id=task_id, state=answer.state, last_error=answer.last_error
    )


class TaskHandle:
    """One submitted task, on a blocking client: its ``id``; :meth:`result` (decoded by
    ``decode``, if given: a task function's handle decodes by its return hint), :meth:`wait`,
    :meth:`cancel`, :meth:`status`."""

    __slots__ = ("client", "decode", "id")

    def __init__(self, client: Client, task_id: str, decode: Decode | None = None) -> None:
        self.client = client
        self.id = task_id
        self.decode = decode

    def __repr__(self) -> str:
        return f"TaskHandle({self.id!r})"

    @property
    def ids(self) -> list[str]:
        return [self.id]

    def wait(self, timeout: float | None = None) -> TaskResult | None:
        """How the task ended, waiting up to ``timeout`` seconds (None: as long as it takes);
        None if it is still pending (see Client.wait_result)."""
        return self.client.wait_result(self.id, timeout=timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The task's result, decoded (None for a task acked without one while this waited),
        waiting up to ``timeout`` seconds (None: as long as it takes). Raises
        TaskNotSucceeded, ResultTimeout or NotFound (see :mod:`wqclient.workflow`)."""
        return _value(self.id, self.wait(timeout), timeout, self.decode)

    def cancel(self) -> str:
        """Cancel the task (see Client.cancel): ``"cancelled"``, ``"cancelling"`` (handed out:
        its handler is stopped) or ``"purged"``."""
        return self.client.cancel(self.id)

    def status(self) -> Task:
        """The task as the broker has it now (see Client.get_task)."""
        return self.client.get_task(self.id)


class GroupHandle:
    """A submitted group, on a blocking client: ``members``, each member's handle, in order."""

    __slots__ = ("members",)

    def __init__(self, members: Sequence[Handle]) -> None:
        self.members = tuple(members)

    def __repr__(self) -> str:
        return f"GroupHandle({list(self.members)!r})"

    @property
    def ids(self) -> list[str]:
        """Every task's id, in the order submitted."""
        return [i for member in self.members for i in member.ids]

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every member's result, in order, all within ``timeout`` seconds (None: as long as it
        takes); raises as soon as one raises (see TaskHandle.result)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for member in self.members:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(member.result(left))
        return out


class ChainHandle:
    """A submitted chain (or chord), on a blocking client: ``steps``, each step's handle."""

    __slots__ = ("steps",)

    def __init__(self, steps: Sequence[Handle]) -> None:
        self.steps = tuple(steps)

    def __repr__(self) -> str:
        return f"ChainHandle({list(self.steps)!r})"

    @property
    def ids(self) -> list[str]:
        """Every task's id, in the order submitted."""
        return [i for step in self.steps for i in step.ids]

    @property
    def last(self) -> Handle:
        """The last step's handle (a chord's callback)."""
        return self.steps[-1]

    def result(self, timeout: float | None = None) -> Any:
        """The last step's result (see TaskHandle.result): it runs only once every step before
        it has succeeded, and is buried if one fails for good."""
        return self.last.result(timeout)


Handle: TypeAlias = TaskHandle | GroupHandle | ChainHandle


class AsyncTaskHandle:
    """One submitted task, on an asyncio client (see TaskHandle)."""

    __slots__ = ("client", "decode", "id")

    def __init__(self, client: AsyncClient, task_id: str, decode: Decode | None = None) -> None:
        self.client = client
        self.id = task_id
        self.decode = decode

    def __repr__(self) -> str:
        return f"AsyncTaskHandle({self.id!r})"

    @property
    def ids(self) -> list[str]:
        return [self.id]

    async def wait(self, timeout: float | None = None) -> TaskResult | None:
        """As TaskHandle.wait."""
        return await self.client.wait_result(self.id, timeout=timeout)

    async def result(self, timeout: float | None = None) -> Any:
        """As TaskHandle.result."""
        return _value(self.id, await self.wait(timeout), timeout, self.decode)

    async def cancel(self) -> str:
        """As TaskHandle.cancel."""
        return await self.client.cancel(self.id)

    async def status(self) -> Task:
        """As TaskHandle.status."""
        return await self.client.get_task(self.id)


class AsyncGroupHandle:
    """A submitted group, on an asyncio client (see GroupHandle)."""

    __slots__ = ("members",)

    def __init__(self, members: Sequence[AsyncHandle]) -> None:
        self.members = tuple(members)

    def __repr__(self) -> str:
        return f"AsyncGroupHandle({list(self.members)!r})"

    @property
    def ids(self) -> list[str]:
        return [i for member in self.members for i in member.ids]

    async def result(self, timeout: float | None = None) -> list[Any]:
        """Every member's result, in order, waited for side by side, within ``timeout``
        seconds; raises as soon as one raises (the other waits are then given up)."""
        waits = [asyncio.ensure_future(member.result(timeout)) for member in self.members]
        try:
            return list(await asyncio.gather(*waits))
        finally:
            for wait in waits:
                wait.cancel()


class AsyncChainHandle:
    """A submitted chain (or chord), on an asyncio client (see ChainHandle)."""

    __slots__ = ("steps",)

    def __init__(self, steps: Sequence[AsyncHandle]) -> None:
        self.steps = tuple(steps)

    def __repr__(self) -> str:
        return f"AsyncChainHandle({list(self.steps)!r})"

    @property
    def ids(self) -> list[str]:
        return [i for step in self.steps for i in step.ids]

    @property
    def last(self) -> AsyncHandle:
        return self.steps[-1]

    async def result(self, timeout: float | None = None) -> Any:
        """The last step's result (see ChainHandle.result)."""
        return await self.last.result(timeout)


AsyncHandle: TypeAlias = AsyncTaskHandle | AsyncGroupHandle | AsyncChainHandle


def _handle(
    shape: _Shape, ids: Sequence[Enqueued], client: Client, decoders: Sequence[Decode | None]
) -> Any:
    if isinstance(shape, int):
        return TaskHandle(client, str(ids[shape]), decoders[shape])
    if isinstance(shape, _Group):
        return GroupHandle([_handle(s, ids, client, decoders) for s in shape.members])
    return ChainHandle([_handle(s, ids, client, decoders) for s in shape.steps])


def _async_handle(
    shape: _Shape, ids: Sequence[Enqueued], client: AsyncClient, decoders: Sequence[Decode | None]
) -> Any:
    if isinstance(shape, int):
        return AsyncTaskHandle(client, str(ids[shape]), decoders[shape])
    if isinstance(shape, _Group):
        return AsyncGroupHandle([_async_handle(s, ids, client, decoders) for s in shape.members])
    return AsyncChainHandle([_async_handle(s, ids, client, decoders) for s in shape.steps])
