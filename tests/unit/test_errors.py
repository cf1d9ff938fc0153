"""The error tree and its two tables: every class maps, and a new subclass maps as its parent."""

from __future__ import annotations

import grpc
import pytest

from wqbroker import errors
from wqbroker.errors import (
    InvalidArgument,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    StoreError,
    Unavailable,
    WqError,
    lookup,
)
from wqbroker.grpc.server import code_for
from wqbroker.http.app import STATUS


def every_error_class() -> list[type[WqError]]:
    found: list[type[WqError]] = []
    todo: list[type[WqError]] = [WqError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (InvalidArgument("x"), 400, grpc.StatusCode.INVALID_ARGUMENT),
        (PayloadTooLarge("x"), 413, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NotFound("x"), 404, grpc.StatusCode.NOT_FOUND),
        (LeaseLost("x"), 409, grpc.StatusCode.FAILED_PRECONDITION),
        (Unavailable("x"), 503, grpc.StatusCode.UNAVAILABLE),
        (StoreError("x"), 503, grpc.StatusCode.UNAVAILABLE),
        (WqError("x"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_each_error_has_its_status_and_code(
    error: WqError, status: int, code: grpc.StatusCode
) -> None:
    assert lookup(STATUS, error) == status
    assert code_for(error) == code


def test_a_new_subclass_maps_as_its_parent() -> None:
    class TaskGone(NotFound):
        pass

    class DiskFull(StoreError):
        pass

    assert lookup(STATUS, TaskGone("x")) == 404
    assert code_for(TaskGone("x")) == grpc.StatusCode.NOT_FOUND
    assert lookup(STATUS, DiskFull("x")) == 503
    assert code_for(DiskFull("x")) == grpc.StatusCode.UNAVAILABLE


def test_every_class_in_the_tree_maps_and_no_bad_input_is_a_5xx() -> None:
    for cls in every_error_class():
        error = cls(0, 0, "x") if cls is errors.UnknownParent else cls("x")
        status = lookup(STATUS, error)
        code_for(error)
        if issubclass(cls, (InvalidArgument, NotFound, LeaseLost)):
            assert 400 <= status < 500, cls
    assert StoreError in every_error_class()
    assert errors.StoreError.__mro__[1] is Unavailable
