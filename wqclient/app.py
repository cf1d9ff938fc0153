"""The task framework (docs/design/tasks.md): :class:`App`, ``@app.task``, and the handler a
:class:`~wqclient.Worker` runs them with.

>>> app = App("grpc://localhost:50051")
>>> @app.task(queue="emails", max_attempts=5, timeout=60)
... async def send_email(to: str, subject: str) -> str: ...
>>> handle = await send_email.enqueue("ann@example.com", subject="hi")
>>> await handle.result(timeout=10)

A task call is one JSON object, the payload convention every language can produce::

    {"task": "billing.charge", "args": ["ann", "12.50"], "kwargs": {}, "pass_results": false}

Values are encoded by :mod:`wqclient.codec` and decoded (and checked, at enqueue and in the
worker) by the function's type hints. Everything here is built on the public client API.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import math
import os
import threading
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from types import MappingProxyType, TracebackType
from typing import Any, Final, Generic, ParamSpec, Protocol, TypeVar, overload

from wqclient import codec
from wqclient.client import ENV_BROKER, AsyncClient, Client
from wqclient.models import DEFAULT_QUEUE, ParentResult, Task
from wqclient.worker import Fail, Retry, describe, seconds_ms
from wqclient.workflow import AsyncTaskHandle, Signature, TaskHandle, Workflow

P = ParamSpec("P")
R = TypeVar("R")


_NOT_UNDER_A_WORKER: Final = "not running under a worker: there is no task to report progress on"


class TaskArgumentError(TypeError):
    """Arguments a task cannot be enqueued with (they do not bind to its parameters, do not
    fit their type hints, or cannot be encoded): the message names the task and the
    parameter."""


class UnknownTaskError(Exception):
    """A payload names a task this worker does not register (retried: a newer worker may)."""


# -- the context ---------------------------------------------------------------------------------


class ProgressSink(Protocol):
    """Where a task's progress goes, and whether it was cancelled: the Worker's ``Task``, or
    what a process pool puts in its place."""

    @property
    def cancelled(self) -> bool: ...

    async def progress(self, value: Any) -> None: ...

    def report_progress(self, value: Any) -> None: ...


class Context:
    """The running task, for a parameter annotated ``Context`` (or :func:`current_context`):
    ``task_id``, ``name``, ``attempt`` (1 on the first), ``max_attempts``, ``queue``,
    ``parents`` (the raw ParentResults; ``parent_results``, their results decoded from JSON),
    ``schedule`` and ``scheduled_for`` (the schedule that enqueued it, if one did),
    ``cancelled``, ``await ctx.progress(value)`` and ``ctx.report_progress(value)`` (from
    synchronous code: blocks)."""

    __slots__ = (
        "attempt",
        "max_attempts",
        "name",
        "parents",
        "queue",
        "schedule",
        "scheduled_for",
        "sink",
        "task_id",
    )

    def __init__(
        self,
        *,
        task_id: str,
        name: str,
        attempt: int,
        max_attempts: int,
        queue: str,
        parents: tuple[ParentResult, ...] = (),
        schedule: str | None = None,
        scheduled_for: datetime | None = None,
        sink: ProgressSink | None = None,
    ) -> None:
        self.task_id = task_id
        self.name = name
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.queue = queue
        self.parents = parents
        self.schedule = schedule
        self.scheduled_for = scheduled_for
        self.sink = sink

    def __repr__(self) -> str:
        return (
            f"Context(task_id={self.task_id!r}, name={self.name!r}, attempt={self.attempt}, "
            f"max_attempts={self.max_attempts}, queue={self.queue!r})"
        )

    @property
    def parent_results(self) -> list[Any]:
        """The parents' results, decoded from JSON, in order (None for one without)."""
        return [parent.result for parent in self.parents]

    @property
    def cancelled(self) -> bool:
        """True once the task was cancelled while it runs (synchronous code should stop)."""
        sink = self.sink
        return sink is not None and sink.cancelled

    async def progress(self, value: Any) -> None:
        """Report how far the task has come (any JSON value), extending its lease."""
        if self.sink is None:
            raise RuntimeError(_NOT_UNDER_A_WORKER)
        await self.sink.progress(value)

    def report_progress(self, value: Any) -> None:
        """:meth:`progress` from synchronous code (a thread): blocks until the broker has it."""
        if self.sink is None:
            raise RuntimeError(_NOT_UNDER_A_WORKER)
        self.sink.report_progress(value)


class _TaskContext(Context):
    """The Context of a task a Worker handed over: made for every task, so its fields are read
    from the task when asked for, not copied."""

    __slots__ = ("_task",)

    def __init__(self, task: Task, name: str) -> None:  # (Context's fields: properties below)
        self._task = task
        self.name = name
        self.sink = task

    @property
    def task_id(self) -> str:  # type: ignore[override]
        return self._task.id

    @property
    def attempt(self) -> int:  # type: ignore[override]
        return self._task.attempts

    @property
    def max_attempts(self) -> int:  # type: ignore[override]
        return self._task.max_attempts

    @property
    def queue(self) -> str:  # type: ignore[override]
        return self._task.queue

    @property
    def parents(self) -> tuple[ParentResult, ...]:  # type: ignore[override]
        return self._task.parents or ()

    @property
    def schedule(self) -> str | None:  # type: ignore[override]
        return self._task.schedule

    @property
    def scheduled_for(self) -> datetime | None:  # type: ignore[override]
        return self._task.scheduled_for


_current: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "wqclient_context", default=None
)


def current_context() -> Context:
    """The Context of the task running here (in its thread too). Raises RuntimeError outside
    a task."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("current_context(): no wq task is running here")
    return ctx


# -- options -------------------------------------------------------------------------------------

Seconds = int | float | timedelta


@dataclass(frozen=True, slots=True)
class _Options:
    """A task's enqueue options, in the client's units (milliseconds)."""

    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    timeout_ms: int | None = None
    result_ttl_ms: int | None = None
    expires_in_ms: int | None = None
    delay_ms: int | None = None
    eta: datetime | None = None
    key: str | None = None
    unique: bool = False
    after: Any = None


_TASK_OPTIONS: Final = frozenset(
    {"queue", "priority", "max_attempts", "timeout", "result_ttl", "expires_in"}
)
_CALL_OPTIONS: Final = _TASK_OPTIONS | {"name", "delay", "eta", "key", "unique", "after"}


def _ms(task: str, option: str, value: Any, *, positive: bool) -> int:
    """Seconds (int, float or timedelta) in whole milliseconds."""
    return seconds_ms(value, f"task {task}: {option}", positive=positive)


def _int(task: str, option: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"task {task}: {option} must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"from {low}"
        raise ValueError(f"task {task}: {option} must be an integer {span}, got {value}")
    return value


def _text(task: str, option: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"task {task}: {option} must be a non-empty string, got {value!r}")
    return value


def _set(task: str, options: _Options, given: Mapping[str, Any]) -> _Options:  # noqa: C901
    """``options`` with ``given`` (the decorator's or with_options' keywords) checked and set
    (None leaves an option as it was)."""
    changes: dict[str, Any] = {}
    for option, value in given.items():
        if value is None:
            continue
        if option == "queue":
            changes["queue"] = _text(task, option, value)
        elif option == "priority":
            changes["priority"] = _int(task, option, value, 0, 9)
        elif option == "max_attempts":
            changes["max_attempts"] = _int(task, option, value, 1)
        elif option in ("timeout", "expires_in"):
            changes[f"{option}_ms"] = _ms(task, option, value, positive=True)
        elif option in ("result_ttl", "delay"):
            changes[f"{option}_ms"] = _ms(task, option, value, positive=False)
            if option == "delay":
                changes["eta"] = None
        elif option == "eta":
            if not isinstance(value, datetime):
                raise TypeError(f"task {task}: eta must be a datetime, got {type(value).__name__}")
            changes.update(eta=value, delay_ms=None)
        elif option == "key":
            changes["key"] = _text(task, option, value)
        elif option == "unique":
            if not isinstance(value, bool):
                raise TypeError(f"task {task}: unique must be true or false, got {value!r}")
            changes["unique"] = value
        elif option == "after":
            changes["after"] = value
    return replace(options, **changes)


def _exceptions(task: str, option: str, value: Any) -> tuple[type[BaseException], ...]:
    if value is None:
        return ()
    kinds = (value,) if isinstance(value, type) else tuple(value)
    for kind in kinds:
        if not (isinstance(kind, type) and issubclass(kind, BaseException)):
            raise TypeError(f"task {task}: {option} must be exception classes, got {kind!r}")
    return kinds


# -- a function's parameters, compiled once ------------------------------------------------------

_POSITIONAL: Final = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _is_context(hint: Any) -> bool:
    if hint is Context:
        return True
    args = typing.get_args(hint)
    return bool(args) and Context in args and all(a in (Context, type(None)) for a in args)


@dataclass(slots=True)
class _Spec:
    """What a task's calls are checked and decoded with: its signature without the Context
    parameter, a decoder per parameter, the Context parameter's place."""

    signature: inspect.Signature  # without the Context parameter
    slot: inspect.Signature | None  # also without the first positional one (a .s()'s results)
    positional: tuple[tuple[str, codec.Decoder], ...]  # in order
    named: dict[str, codec.Decoder]  # those that can be given by name
    positional_names: dict[str, int]  # positional-or-keyword: name -> index
    varargs: tuple[str, codec.Decoder] | None
    varkw: tuple[str, codec.Decoder] | None
    required_positional: tuple[tuple[int, str], ...]
    required_named: tuple[str, ...]
    result: codec.Decoder
    context: str | None = None  # the Context parameter's name ...
    context_index: int | None = None  # ... and its index among the positional ones (if one)
    context_keyword: bool = True  # (False: it is positional-only)

    def decoder_at(self, index: int) -> tuple[str, codec.Decoder] | None:
        if index < len(self.positional):
            return self.positional[index]
        return self.varargs


def _compile(fn: Callable[..., Any]) -> _Spec:
    """A function's _Spec (raises NameError if a hint names what is not defined yet)."""
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)
    kept: list[inspect.Parameter] = []
    positional: list[tuple[str, codec.Decoder]] = []
    named: dict[str, codec.Decoder] = {}
    positional_names: dict[str, int] = {}
    varargs = varkw = None
    required_positional: list[tuple[int, str]] = []
    required_named: list[str] = []
    context = context_index = None
    context_keyword = True
    for parameter in signature.parameters.values():
        hint = hints.get(parameter.name, Any)
        if _is_context(hint):
            context = parameter.name
            context_index = len(positional) if parameter.kind in _POSITIONAL else None
            context_keyword = parameter.kind is not inspect.Parameter.POSITIONAL_ONLY
            continue
        kept.append(parameter)
        decoder = codec.decoder(hint)
        kind = parameter.kind
        required = parameter.default is inspect.Parameter.empty
        if kind in _POSITIONAL:
            if required:
                required_positional.append((len(positional), parameter.name))
            if kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
                named[parameter.name] = decoder
                positional_names[parameter.name] = len(positional)
            positional.append((parameter.name, decoder))
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            varargs = (parameter.name, decoder)
        elif kind is inspect.Parameter.KEYWORD_ONLY:
            named[parameter.name] = decoder
            if required:
                required_named.append(parameter.name)
        else:
            varkw = (parameter.name, decoder)
    plain = signature.replace(parameters=kept)
    first = next((p for p in kept if p.kind in _POSITIONAL), None)
    slot = None if first is None else plain.replace(parameters=[p for p in kept if p is not first])
    return _Spec(
        plain,
        slot,
        tuple(positional),
        named,
        positional_names,
        varargs,
        varkw,
        tuple(required_positional),
        tuple(required_named),
        codec.decoder(hints.get("return", Any)),
        context,
        context_index,
        context_keyword,
    )


class _Compiled:
    """A function's _Spec, made at decoration, or on first use if a hint names something not
    defined yet then. Shared by a task function and its with_options copies."""

    __slots__ = ("fn", "spec")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.spec: _Spec | None = None
        try:
            self.spec = _compile(fn)
        except NameError:
            pass

    def get(self) -> _Spec:
        spec = self.spec
        if spec is None:
            spec = self.spec = _compile(self.fn)
        return spec

    def required(self) -> bool:
        """Whether the function has parameters that must be given."""
        spec = self.get()
        return bool(spec.required_positional or spec.required_named)


# -- task functions ------------------------------------------------------------------------------


class TaskFunction(Generic[P, R]):
    """A function made a task by ``@app.task``: call it to run it here and now; ``enqueue``
    (asyncio) or ``enqueue_sync`` to have a worker run it; ``s``/``si`` for workflows;
    ``with_options`` for a call's options. ``name``, ``queue``, ``fn`` (the function),
    ``is_async``, ``retry_on``, ``give_up_on``."""

    def __init__(
        self,
        app: App,
        fn: Callable[P, R],
        name: str,
        options: _Options,
        retry_on: tuple[type[BaseException], ...] = (),
        give_up_on: tuple[type[BaseException], ...] = (),
        compiled: _Compiled | None = None,
    ) -> None:
        self.app = app
        self.fn = fn
        self.name = name
        self.options = options
        self.retry_on = retry_on
        self.give_up_on = give_up_on
        self.is_async = inspect.iscoroutinefunction(fn)
        self._compiled = compiled or _Compiled(fn)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"<task {self.name} (queue {self.queue})>"

    @property
    def queue(self) -> str:
        return self.options.queue or self.app.default_queue

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the function here and now (a Context parameter not given gets the current
        task's context, if one is running here, else None)."""
        spec = self._compiled.get()
        if spec.context is not None and spec.context not in kwargs:
            index = spec.context_index
            if index is None or len(args) <= index:
                kwargs[spec.context] = _current.get()
        return self.fn(*args, **kwargs)

    def with_options(self, **options: Any) -> TaskFunction[P, R]:
        """A copy with these options for its calls: ``queue``, ``priority`` (0-9),
        ``max_attempts``, ``timeout``, ``result_ttl``, ``expires_in``, ``delay`` (seconds:
        int, float or timedelta), ``eta`` (a datetime), ``key`` (idempotency key), ``unique``,
        ``after`` (handles or ids), ``name`` (another task's)."""
        unknown = set(options) - _CALL_OPTIONS
        if unknown:
            which = sorted(unknown)[0]
            if which in ("retry_on", "give_up_on"):
                raise TypeError(
                    f"task {self.name}: {which} is how the worker runs the task: give it to "
                    "@app.task, not to a call"
                )
            raise TypeError(f"task {self.name}: with_options() has no option {which!r}")
        name = (
            self.name if options.get("name") is None else _text(self.name, "name", options["name"])
        )
        return TaskFunction(
            self.app,
            self.fn,
            name,
            _set(self.name, self.options, options),
            self.retry_on,
            self.give_up_on,
            self._compiled,
        )

    # -- producing ----------------------------------------------------------------------------

    async def enqueue(self, *args: Any, **kwargs: Any) -> AsyncTaskHandle:
        """Enqueue a call (checked against the function's parameters and hints: a
        TaskArgumentError if it does not fit) through the App's client for this event loop."""
        payload = self.payload(args, kwargs)
        client = self.app.client
        task_id = await client.enqueue(payload, **self._enqueue_options())
        return AsyncTaskHandle(client, str(task_id), self._result_decoder())

    def enqueue_sync(self, *args: Any, **kwargs: Any) -> TaskHandle:
        """:meth:`enqueue` from synchronous code (the App's blocking client)."""
        payload = self.payload(args, kwargs)
        client = self.app.sync_client
        task_id = client.enqueue(payload, **self._enqueue_options())
        return TaskHandle(client, str(task_id), self._result_decoder())

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature of a call for a workflow, which passes its parents' results first (one
        parent's result as it is, several as a list): the first positional parameter is left
        for them unless the arguments given fill the function without it."""
        return self._signature(self.payload(args, kwargs, results=True))

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """An immutable signature: the call as given, its parents' results not passed."""
        return self._signature(self.payload(args, kwargs))

    def payload(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], *, results: bool = False
    ) -> bytes:
        """The payload convention's JSON text of a call, its arguments checked (raises
        TaskArgumentError). ``results``: a ``.s()`` call's (``pass_results``)."""
        spec = self._compiled.get()
        if results:
            call = self._results_call(spec, args, kwargs)
        else:
            self._bind(spec.signature, args, kwargs, partial=False)
            call = self._encode(spec, args, kwargs, 0)
        if results:
            call["pass_results"] = True
        return json.dumps(call, separators=(",", ":"), allow_nan=False).encode()

    def _results_call(
        self, spec: _Spec, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A ``.s()`` call: as complete as given, else with the first positional parameter
        left for the parents' results."""
        try:
            self._bind(spec.signature, args, kwargs, partial=False)
            return self._encode(spec, args, kwargs, 0)
        except TaskArgumentError as whole:
            if spec.slot is None:
                raise
            try:
                self._bind(spec.slot, args, kwargs, partial=True)
                return self._encode(spec, args, kwargs, 1)
            except TaskArgumentError:
                raise whole from None

    def _bind(
        self,
        signature: inspect.Signature,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        partial: bool,
    ) -> None:
        try:
            if partial:
                signature.bind_partial(*args, **kwargs)
            else:
                signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TaskArgumentError(f"task {self.name}: {e}") from None

    def _encode(
        self, spec: _Spec, args: Sequence[Any], kwargs: Mapping[str, Any], offset: int
    ) -> dict[str, Any]:
        """The call's arguments encoded, each checked against its hint (``offset``: the
        positional parameters left for the parents' results)."""
        out_args = []
        for i, value in enumerate(args):
            where = spec.decoder_at(i + offset)
            name, decoder = where if where is not None else (f"args[{i}]", _ANY)
            out_args.append(self._checked(name, decoder, value))
        out_kwargs = {}
        for key, value in kwargs.items():
            decoder = spec.named.get(key) or (spec.varkw[1] if spec.varkw else _ANY)
            out_kwargs[key] = self._checked(key, decoder, value)
        return {"task": self.name, "args": out_args, "kwargs": out_kwargs}

    def _checked(self, name: str, decoder: codec.Decoder, value: Any) -> Any:
        try:
            data = codec.encode(value)
        except codec.EncodeError as e:
            raise TaskArgumentError(
                f"task {self.name}: argument {name!r}{_at(e.path)}: {e.problem}"
            ) from None
        if not decoder.identity:
            try:
                decoder.decode(data)
            except codec.DecodeError as e:
                raise TaskArgumentError(
                    f"task {self.name}: argument {name!r}{_at(e.path)} does not fit its hint "
                    f"{_hint_name(decoder.hint)}: {e.problem}"
                ) from None
        return data

    def _enqueue_options(self) -> dict[str, Any]:
        o = self.options
        delay_ms = o.delay_ms
        if o.eta is not None:
            seconds = (
                (o.eta - self.app.now()).total_seconds()
                if o.eta.tzinfo
                else (o.eta.timestamp() - self.app.now().timestamp())
            )
            delay_ms = max(0, math.ceil(seconds * 1000))
        queue = self.queue
        return {
            "max_attempts": o.max_attempts,
            "delay_ms": delay_ms,
            "queue": None if queue == DEFAULT_QUEUE else queue,
            "priority": o.priority,
            "idempotency_key": o.key,
            "expires_in_ms": o.expires_in_ms,
            "timeout_ms": o.timeout_ms,
            "unique": o.unique,
            "after": o.after,
            "result_ttl_ms": o.result_ttl_ms,
        }

    def _signature(self, payload: bytes) -> Signature:
        o = self._enqueue_options()
        return Signature(
            payload,
            queue=o["queue"],
            priority=o["priority"],
            max_attempts=o["max_attempts"],
            delay_ms=o["delay_ms"],
            result_ttl_ms=o["result_ttl_ms"],
            expires_in_ms=o["expires_in_ms"],
            timeout_ms=o["timeout_ms"],
            idempotency_key=o["idempotency_key"],
            after=o["after"],
            unique=o["unique"],
            decode=self._result_decoder(),
        )

    def _result_decoder(self) -> Callable[[Any], Any] | None:
        result = self._compiled.get().result
        return None if result.identity else result.decode

    # -- running ------------------------------------------------------------------------------

    def invoke(self, args: list[Any], kwargs: dict[str, Any], ctx: Context) -> Any:
        """Call the function with decoded arguments, ``ctx`` given to its Context parameter
        (if it has one) and :func:`current_context` set while it runs: what it returns (a
        coroutine, for an async function, which sets the context while it is awaited)."""
        args, kwargs = self._with_context(args, kwargs, ctx)
        if self.is_async:
            return self._run_async(args, kwargs, ctx)
        token = _current.set(ctx)
        try:
            return self.fn(*args, **kwargs)
        finally:
            _current.reset(token)

    async def _run_async(self, args: list[Any], kwargs: dict[str, Any], ctx: Context) -> Any:
        token = _current.set(ctx)
        try:
            return await self.fn(*args, **kwargs)  # type: ignore[misc]
        finally:
            _current.reset(token)

    def _with_context(
        self, args: list[Any], kwargs: dict[str, Any], ctx: Context
    ) -> tuple[list[Any], dict[str, Any]]:
        spec = self._compiled.spec or self._compiled.get()
        if spec.context is None:
            return args, kwargs
        index = spec.context_index
        if index is None or len(args) < index or (len(args) == index and spec.context_keyword):
            return args, {**kwargs, spec.context: ctx}
        return [*args[:index], ctx, *args[index:]], kwargs

    def decode_call(
        self, args: list[Any], kwargs: dict[str, Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """A payload's arguments decoded by the function's hints; Fail (naming the parameter)
        if they do not fit it."""
        spec = self._compiled.get()
        if args:
            args = self._decode_args(spec, args)
        if kwargs:
            kwargs = self._decode_kwargs(spec, args, kwargs)
        for index, name in spec.required_positional:
            if index >= len(args) and name not in kwargs:
                raise Fail(f"task {self.name}: missing the argument {name!r}")
        for name in spec.required_named:
            if name not in kwargs:
                raise Fail(f"task {self.name}: missing the argument {name!r}")
        return args, kwargs

    def _decode_args(self, spec: _Spec, args: list[Any]) -> list[Any]:
        if len(args) > len(spec.positional) and spec.varargs is None:
            raise Fail(
                f"task {self.name}: takes {len(spec.positional)} positional arguments, the "
                f"payload gives {len(args)}"
            )
        out = list(args)
        for i, value in enumerate(args):
            where = spec.decoder_at(i)
            assert where is not None
            name, decoder = where
            if not decoder.identity:
                out[i] = self._decoded(name, decoder, value)
        return out

    def _decode_kwargs(
        self, spec: _Spec, args: list[Any], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        out = {}
        for name, value in kwargs.items():
            decoder = spec.named.get(name)
            if decoder is None:
                if spec.varkw is None:
                    raise Fail(f"task {self.name}: has no parameter {name!r}")
                decoder = spec.varkw[1]
            elif spec.positional_names.get(name, len(args)) < len(args):
                raise Fail(f"task {self.name}: the argument {name!r} is given twice")
            out[name] = value if decoder.identity else self._decoded(name, decoder, value)
        return out

    def _decoded(self, name: str, decoder: codec.Decoder, value: Any) -> Any:
        try:
            return decoder.decode(value)
        except codec.DecodeError as e:
            raise Fail(
                f"task {self.name}: argument {name!r}{_at(e.path)} does not fit its hint "
                f"{_hint_name(decoder.hint)}: {e.problem}"
            ) from None

    def outcome(self, error: Exception) -> Exception:
        """What a failure becomes: Retry and Fail as they are; one of ``give_up_on``, or not
        one of ``retry_on`` (when given), a Fail; any other as it is (the broker's backoff)."""
        if isinstance(error, Retry | Fail):
            return error
        if self.give_up_on and isinstance(error, self.give_up_on):
            return Fail(describe(error))
        if self.retry_on and not isinstance(error, self.retry_on):
            return Fail(describe(error))
        return error


_ANY: Final = codec.Decoder(Any, None)


def _at(path: str) -> str:
    return f" at {path}" if path else ""


def _hint_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__qualname__
    return repr(hint).replace("typing.", "")


# -- running sync functions ----------------------------------------------------------------------


class SyncRunner(Protocol):
    """Where a worker's handler runs a synchronous task function (threads, processes)."""

    async def run(
        self, fn: TaskFunction[Any, Any], args: list[Any], kwargs: dict[str, Any], ctx: Context
    ) -> Any: ...

    async def close(self) -> None: ...


class ThreadRunner:
    """Synchronous task functions in a pool of ``size`` threads, the context set in each."""

    def __init__(self, size: int = 8) -> None:
        if size < 1:
            raise ValueError("a ThreadRunner needs at least one thread")
        self.size = size
        self._pool: ThreadPoolExecutor | None = None

    async def run(
        self, fn: TaskFunction[Any, Any], args: list[Any], kwargs: dict[str, Any], ctx: Context
    ) -> Any:
        pool = self._pool
        if pool is None:
            pool = self._pool = ThreadPoolExecutor(self.size, thread_name_prefix="wq-task")
        return await asyncio.get_running_loop().run_in_executor(pool, fn.invoke, args, kwargs, ctx)

    async def close(self) -> None:
        """Take no more (threads still running a function are let finish on their own)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# -- the worker's handler ------------------------------------------------------------------------


class _Handler:
    """A Worker's handler for an App's tasks (see App.handler)."""

    def __init__(self, app: App, runner: SyncRunner | None, threads: int) -> None:
        self._tasks = app._tasks
        self._runner = runner
        self._threads = threads
        self._own: ThreadRunner | None = None

    def __repr__(self) -> str:
        return f"<wq handler of {len(self._tasks)} tasks>"

    async def __call__(self, task: Task) -> bytes | None:
        fn, args, kwargs = self._call(task)
        if args or kwargs or fn._compiled.required():
            args, kwargs = fn.decode_call(args, kwargs)
        ctx = _TaskContext(task, fn.name)
        try:
            if fn.is_async:  # (invoke's, inline: no coroutine of its own per task)
                args, kwargs = fn._with_context(args, kwargs, ctx)
                token = _current.set(ctx)
                try:
                    value = await fn.fn(*args, **kwargs)
                finally:
                    _current.reset(token)
            else:
                value = await self._sync_runner().run(fn, args, kwargs, ctx)
        except Exception as e:
            raise fn.outcome(e) from e
        if value is None:
            return None
        try:
            return codec.dumps(value)
        except (TypeError, ValueError, RecursionError) as e:
            raise Fail(f"result of {fn.name} cannot be encoded: {e}") from None

    def _call(  # noqa: C901 (one check a member of the convention)
        self, task: Task
    ) -> tuple[TaskFunction[Any, Any], list[Any], dict[str, Any]]:
        """The payload's task function and arguments (raw); Fail for a payload that is not a
        task call, UnknownTaskError for a task not registered here."""
        try:
            call, _ = _scan(task.payload_json.decode(), 0)
        except (StopIteration, ValueError, UnicodeDecodeError):  # (space first, say)
            try:
                call = json.loads(task.payload_json)
            except ValueError:
                raise Fail("the payload is not JSON") from None
        if type(call) is not dict:
            raise Fail(f'the payload is not a task call (an object with "task"), got {_kind(call)}')
        name = call.get("task")
        if type(name) is not str:
            raise Fail(
                f"the payload's \"task\" must be a task's name (a string), got {_kind(name)}"
            )
        fn = self._tasks.get(name)
        if fn is None:
            known = ", ".join(sorted(self._tasks)) or "none"
            raise UnknownTaskError(
                f"no task {name!r} is registered here (this worker has: {known})"
            )
        args = call.get("args", _NO_ARGS)
        if type(args) is not list:
            raise Fail(f'task {name}: the payload\'s "args" must be an array, got {_kind(args)}')
        kwargs = call.get("kwargs", _NO_KWARGS)
        if type(kwargs) is not dict:
            raise Fail(
                f'task {name}: the payload\'s "kwargs" must be an object, got {_kind(kwargs)}'
            )
        passing = call.get("pass_results", False)
        if type(passing) is not bool:
            raise Fail(f'task {name}: the payload\'s "pass_results" must be true or false')
        if passing:
            parents = task.parents
            if parents:
                first = parents[0].result if len(parents) == 1 else [p.result for p in parents]
                args = [first, *args]
        return fn, args, kwargs

    def _sync_runner(self) -> SyncRunner:
        runner = self._runner
        if runner is None:
            runner = self._runner = self._own = ThreadRunner(self._threads)
        return runner

    async def close(self) -> None:
        """Close the thread pool this handler made for itself (a runner given is the giver's
        to close)."""
        if self._own is not None:
            await self._own.close()


# The JSON scanner without json.loads' checks (the broker keeps only valid JSON).
_scan: Final[Callable[[str, int], tuple[Any, int]]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_NO_ARGS: Final[list[Any]] = []
_NO_KWARGS: Final[dict[str, Any]] = {}


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


# -- the app -------------------------------------------------------------------------------------


class App:
    """A set of task functions and the broker they go to.

    ``broker``: its URL (``http://host:port``, ``grpc://host:port``, ...); None: ``$WQ_BROKER``,
    else the client's default. ``token``, ``ca_file``: as the clients'. ``default_queue``: the
    queue of a task that names none. ``now``: the wall clock an ``eta`` is measured against
    (tests pass a fake). The App makes its clients when first needed: an AsyncClient per
    running event loop (:attr:`client`), a blocking Client for the ``_sync`` calls
    (:attr:`sync_client`); ``await app.aclose()`` / ``app.close()`` (or ``async with`` /
    ``with``) closes them."""

    def __init__(
        self,
        broker: str | None = None,
        *,
        token: str | None = None,
        ca_file: str | None = None,
        default_queue: str = DEFAULT_QUEUE,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        self.broker: str | None = (
            broker if broker is not None else os.environ.get(ENV_BROKER) or None
        )
        self.token = token
        self.ca_file = ca_file
        self.default_queue = default_queue
        self.now: Callable[[], datetime] = now or _utc_now
        self._tasks: dict[str, TaskFunction[Any, Any]] = {}
        self.tasks: Mapping[str, TaskFunction[Any, Any]] = MappingProxyType(self._tasks)
        self._clients: dict[asyncio.AbstractEventLoop, AsyncClient] = {}
        self._sync: Client | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"App({self.broker!r}, {len(self._tasks)} tasks)"

    # -- tasks --------------------------------------------------------------------------------

    @overload
    def task(self, fn: Callable[P, R], /) -> TaskFunction[P, R]: ...

    @overload
    def task(
        self,
        *,
        name: str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        timeout: Seconds | None = None,
        result_ttl: Seconds | None = None,
        expires_in: Seconds | None = None,
        retry_on: type[BaseException] | Sequence[type[BaseException]] | None = None,
        give_up_on: type[BaseException] | Sequence[type[BaseException]] | None = None,
    ) -> Callable[[Callable[P, R]], TaskFunction[P, R]]: ...

    def task(  # type: ignore[misc]
        self, fn: Callable[..., Any] | None = None, /, **options: Any
    ) -> Any:
        """Make a function a task: ``@app.task`` or ``@app.task(queue=..., priority=...,
        max_attempts=..., timeout=..., result_ttl=..., expires_in=..., retry_on=(...),
        give_up_on=(...), name=...)`` (seconds: int, float or timedelta)."""
        if fn is not None:
            return self._register(fn, options)

        def decorate(function: Callable[P, R]) -> TaskFunction[P, R]:
            return self._register(function, options)

        return decorate

    def _register(
        self, fn: Callable[..., Any], options: Mapping[str, Any]
    ) -> TaskFunction[Any, Any]:
        if not callable(fn):
            raise TypeError(f"@app.task takes a function, got {type(fn).__name__}")
        name = options.get("name")
        if name is None:
            if fn.__module__ == "__main__":
                raise ValueError(
                    f"task {fn.__qualname__}: a function defined in __main__ needs a name= (a "
                    "worker imports your module by its own name)"
                )
            name = f"{fn.__module__}.{fn.__qualname__}"
        name = _text(str(name), "name", name)
        unknown = set(options) - _TASK_OPTIONS - {"name", "retry_on", "give_up_on"}
        if unknown:
            raise TypeError(f"task {name}: @app.task has no option {sorted(unknown)[0]!r}")
        if name in self._tasks:
            raise ValueError(f"task {name}: a task of that name is registered already")
        settings = {k: v for k, v in options.items() if k in _TASK_OPTIONS}
        task: TaskFunction[Any, Any] = TaskFunction(
            self,
            fn,
            name,
            _set(name, _Options(), settings),
            _exceptions(name, "retry_on", options.get("retry_on")),
            _exceptions(name, "give_up_on", options.get("give_up_on")),
        )
        self._tasks[name] = task
        return task

    def queues(self) -> list[str]:
        """The queues its tasks name, sorted (the default queue if it has no tasks)."""
        return sorted({t.queue for t in self._tasks.values()} or {self.default_queue})

    def handler(
        self, runner: SyncRunner | None = None, *, threads: int = 8
    ) -> Callable[[Task], Awaitable[Any]]:
        """An asyncio handler for a :class:`~wqclient.Worker` that runs this App's tasks:
        async functions on the loop, synchronous ones through ``runner`` (default: a
        :class:`ThreadRunner` of ``threads``, made on first use; the handler's ``close()``
        closes it). It returns the result as JSON bytes (None: none)."""
        if threads < 1:
            raise ValueError("threads must be at least 1")
        return _Handler(self, runner, threads)

    # -- submitting ---------------------------------------------------------------------------

    async def submit(self, workflow: Workflow[Any, Any]) -> Any:
        """Enqueue a workflow (chain, group, chord of ``.s()``/``.si()``) in one batch; its
        handle, whose results are decoded by each task's return hint."""
        return await workflow.submit(self.client)

    def submit_sync(self, workflow: Workflow[Any, Any]) -> Any:
        """:meth:`submit` from synchronous code (a blocking handle)."""
        return workflow.submit(self.sync_client)

    # -- clients ------------------------------------------------------------------------------

    @property
    def client(self) -> AsyncClient:
        """The App's AsyncClient for the running event loop (made on first use)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [other for other in self._clients if other.is_closed()]:
                del self._clients[old]
            client = self._clients[loop] = AsyncClient(
                self.broker, token=self.token, ca_file=self.ca_file
            )
        return client

    @property
    def sync_client(self) -> Client:
        """The App's blocking Client (made on first use)."""
        with self._lock:
            if self._sync is None:
                self._sync = Client(self.broker, token=self.token, ca_file=self.ca_file)
            return self._sync

    async def aclose(self) -> None:
        """Close the client of this event loop, and the blocking one."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()
        with self._lock:
            sync, self._sync = self._sync, None
        if sync is not None:
            await asyncio.to_thread(sync.close)

    def close(self) -> None:
        """Close the blocking client (an event loop's client is closed by ``aclose``)."""
        with self._lock:
            sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()

    async def __aenter__(self) -> App:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __enter__(self) -> App:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _utc_now() -> datetime:
    return datetime.now(UTC)


__all__ = [
    "App",
    "Context",
    "ProgressSink",
    "SyncRunner",
    "TaskArgumentError",
    "TaskFunction",
    "ThreadRunner",
    "UnknownTaskError",
    "current_context",
]
