"""wqclient.codec (docs/design/tasks.md): the encoder table row by row, values decoded back by
their type hints with pydantic and without it (the standard types), the same JSON text either
way, and clear errors for what cannot be encoded or does not fit a hint."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any, Literal, Optional, Union
from uuid import UUID

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import examples
from wqclient import codec

PATHS = ["pydantic", "standard"]


@pytest.fixture(params=PATHS)
def use_pydantic(request: pytest.FixtureRequest) -> bool:
    return bool(request.param == "pydantic")


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 9


@dataclass
class Point:
    x: int
    y: float
    label: str = "p"


@dataclass
class Shipment:
    id: UUID
    when: datetime
    weights: list[Decimal]
    colour: Colour
    blob: bytes
    at: Point
    notes: dict[str, str] = field(default_factory=dict)


class Invoice(pydantic.BaseModel):
    number: int
    total: Decimal
    due: date


UTC_PLUS_0530 = timezone(timedelta(hours=5, minutes=30))
SHIPMENT = Shipment(
    UUID("12345678-9ABC-DEF0-1234-56789ABCDEF0"),
    datetime(2026, 12, 6, 10, 0, tzinfo=UTC),
    [Decimal("12.50"), Decimal("0.001")],
    Colour.BLUE,
    b"\x00\xffhi",
    Point(1, 2.5),
    {"k": "v"},
)

# Every row of the table: a value, its JSON text, the hint it is decoded back by.
TABLE: list[tuple[Any, str | None, Any]] = [
    (datetime(2026, 12, 6, 10, 0, 0), '"2026-12-06T10:00:00"', datetime),
    (
        datetime(2026, 12, 6, 10, 0, 0, 5, tzinfo=UTC),
        '"2026-12-06T10:00:00.000005+00:00"',
        datetime,
    ),
    (datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC_PLUS_0530), '"2026-01-02T03:04:05+05:30"', datetime),
    (date(2026, 12, 6), '"2026-12-06"', date),
    (time(10, 30, 1, 250000), '"10:30:01.250000"', time),
    (timedelta(days=1, hours=2, minutes=3, seconds=4.5), '"P1DT2H3M4.5S"', timedelta),
    (timedelta(0), '"PT0S"', timedelta),
    (timedelta(seconds=-1), '"-PT1S"', timedelta),
    (timedelta(days=400), '"P1Y35D"', timedelta),
    (UUID("12345678-9ABC-DEF0-1234-56789ABCDEF0"), '"12345678-9abc-def0-1234-56789abcdef0"', UUID),
    (Decimal("12.50"), '"12.50"', Decimal),
    (Decimal("1E+3"), '"1E+3"', Decimal),
    (Colour.RED, '"red"', Colour),
    (Level.HIGH, "9", Level),
    (b"hello?", '"aGVsbG8/"', bytes),
    (b"\xff", '"/w=="', bytes),
    (Point(1, 2.5), '{"x":1,"y":2.5,"label":"p"}', Point),
    (Invoice(number=7, total=Decimal("9.99"), due=date(2027, 1, 1)), None, Invoice),
    ((1, "a"), '[1,"a"]', tuple[int, str]),
    ([1, 2], "[1,2]", list[int]),
    ({3}, "[3]", set[int]),
    (frozenset({"x"}), '["x"]', frozenset[str]),
    ({"a": Decimal("1.5")}, '{"a":"1.5"}', dict[str, Decimal]),
    (SHIPMENT, None, Shipment),
]


def ids(row: tuple[Any, str | None, Any]) -> str:
    return type(row[0]).__name__ + ":" + str(row[1])


@pytest.mark.parametrize("row", TABLE, ids=ids)
def test_every_row_of_the_table(row: tuple[Any, str | None, Any], use_pydantic: bool) -> None:
    value, text, hint = row
    data = codec.dumps(value)
    if text is not None:
        assert data == text.encode()
    decoded = codec.decoder(hint, pydantic=use_pydantic).decode(json.loads(data))
    assert decoded == value
    assert type(decoded) is type(value)


def test_a_pydantic_model_is_its_json_dump_and_a_dataclass_its_fields() -> None:
    invoice = Invoice(number=7, total=Decimal("9.99"), due=date(2027, 1, 1))
    assert json.loads(codec.dumps(invoice)) == invoice.model_dump(mode="json")
    assert json.loads(codec.dumps(SHIPMENT)) == {
        "id": "12345678-9abc-def0-1234-56789abcdef0",
        "when": "2026-12-06T10:00:00+00:00",
        "weights": ["12.50", "0.001"],
        "colour": "blue",
        "blob": "AP9oaQ==",
        "at": {"x": 1, "y": 2.5, "label": "p"},
        "notes": {"k": "v"},
    }


def test_keys_of_str_subclasses_and_str_enums_are_their_text() -> None:
    class Key(enum.StrEnum):
        A = "a"

    assert codec.dumps({Key.A: 1}) == b'{"a":1}'


# -- what cannot be encoded ------------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "where", "what"),
    [
        (float("nan"), "", "nan is not allowed"),
        (float("-inf"), "", "-inf is not allowed"),
        ([1, {"a": [float("inf")]}], "[1]['a'][0]", "inf is not allowed"),
        ({1: "x"}, "", "a dict key must be a string, got int"),
        ({"ok": {(1, 2): "x"}}, "['ok']", "a dict key must be a string, got tuple"),
        (Opaque(), "", "a value of type tests.unit.test_codec.Opaque cannot be encoded"),
        (Point(1, float("nan")), ".y", "nan is not allowed"),
        (Decimal("NaN"), "", "Decimal NaN is not allowed"),
        (Decimal("Infinity"), "", "Decimal Infinity is not allowed"),
    ],
)
def test_what_cannot_be_encoded_is_a_type_error_saying_where(
    value: Any, where: str, what: str
) -> None:
    with pytest.raises(TypeError) as caught:
        codec.dumps(value)
    error = caught.value
    assert isinstance(error, codec.EncodeError)
    assert (error.path, error.problem.startswith(what)) == (where, True), str(error)


# -- what does not fit a hint ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hint", "value", "where"),
    [
        (int, "abc", ""),
        (int, 1.5, ""),
        (str, 5, ""),
        (list[int], [1, "a"], "[1]"),
        (dict[str, int], {"a": "b"}, "['a']"),
        (datetime, "not a date", ""),
        (UUID, "xyz", ""),
        (Decimal, "twelve", ""),
        (Colour, "green", ""),
        (Point, {"x": 1}, ""),
        (Point, {"x": "one", "y": 2}, ""),
        (Point, [1, 2], ""),
        (tuple[int, str], [1], ""),
        (Literal["a", "b"], "c", ""),
        (Optional[int], "x", ""),  # noqa: UP045 (the spelling is what is tested)
        (Union[int, datetime], [], ""),  # noqa: UP007
        (Invoice, {"number": "x", "total": "1", "due": "2020-01-01"}, ""),
        (None, 1, ""),
    ],
)
def test_a_value_that_does_not_fit_its_hint_is_a_decode_error(
    hint: Any, value: Any, where: str, use_pydantic: bool
) -> None:
    with pytest.raises(codec.DecodeError) as caught:
        codec.decoder(hint, pydantic=use_pydantic).decode(value)
    assert caught.value.path.startswith(where)
    assert caught.value.problem


def test_the_standard_path_names_the_field_and_the_item() -> None:
    with pytest.raises(codec.DecodeError, match=r"^\[1\]\.x: expected an integer, got a string"):
        codec.decoder(list[Point], pydantic=False).decode([{"x": 1, "y": 2}, {"x": "1", "y": 2}])
    with pytest.raises(codec.DecodeError, match="Point has no field 'z'"):
        codec.decoder(Point, pydantic=False).decode({"x": 1, "y": 2, "z": 3})


def test_hints_it_cannot_check_take_values_as_they_are(use_pydantic: bool) -> None:
    for hint in (Any, object):
        assert codec.decoder(hint, pydantic=use_pydantic).identity
    opaque = codec.decoder(Opaque, pydantic=use_pydantic)
    assert opaque.decode({"a": 1}) == {"a": 1}


def test_optional_and_union_take_either(use_pydantic: bool) -> None:
    maybe = codec.decoder(datetime | None, pydantic=use_pydantic)
    assert maybe.decode(None) is None
    assert maybe.decode("2026-01-01T00:00:00") == datetime(2026, 1, 1)
    assert codec.decoder(Literal["a", 1], pydantic=use_pydantic).decode(1) == 1


# -- durations -------------------------------------------------------------------------------------

timedeltas = st.timedeltas(min_value=timedelta(days=-(10**6)), max_value=timedelta(days=10**6))


@settings(max_examples=examples(500))
@given(timedeltas)
def test_a_duration_is_written_as_pydantic_writes_it_and_read_back(value: timedelta) -> None:
    text = codec.duration(value)
    assert json.dumps(text).encode() == pydantic.TypeAdapter(timedelta).dump_json(value)
    assert codec.parse_duration(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("PT1H30M", timedelta(hours=1, minutes=30)),
        ("P2W", timedelta(weeks=2)),
        ("P1M", timedelta(days=30)),
        ("-P1DT0.5S", -timedelta(days=1, seconds=0.5)),
        ("PT0.25H", timedelta(minutes=15)),
    ],
)
def test_other_producers_durations_are_read(text: str, value: timedelta) -> None:
    assert codec.parse_duration(text) == value
    assert codec.decoder(timedelta, pydantic=False).decode(text) == value


@pytest.mark.parametrize("text", ["", "P", "PT", "1D", "P1H", "PxD", "P1DT"])
def test_what_is_not_a_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not an ISO 8601 duration"):
        codec.parse_duration(text)


# -- round trips -----------------------------------------------------------------------------------

OFFSETS = st.sampled_from([None, UTC, UTC_PLUS_0530, timezone(timedelta(hours=-8))])
finite = st.floats(allow_nan=False, allow_infinity=False)
decimals = st.decimals(
    allow_nan=False, allow_infinity=False, places=4, min_value=-(10**12), max_value=10**12
)
points = st.builds(Point, st.integers(), finite, st.text())
leaves: list[tuple[Any, st.SearchStrategy[Any]]] = [
    (int, st.integers()),
    (float, finite),
    (str, st.text()),
    (bool, st.booleans()),
    (datetime, st.datetimes(timezones=OFFSETS)),
    (date, st.dates()),
    (time, st.times()),
    (timedelta, timedeltas),
    (UUID, st.uuids()),
    (Decimal, decimals),
    (Colour, st.sampled_from(Colour)),
    (bytes, st.binary()),
    (Point, points),
    (int | None, st.none() | st.integers()),
]


def _containers(hint: Any) -> list[tuple[Any, st.SearchStrategy[Any]]]:
    of = dict(leaves).get(hint)
    assert of is not None
    return [
        (list[hint], st.lists(of, max_size=3)),
        (tuple[hint, ...], st.lists(of, max_size=3).map(tuple)),
        (dict[str, hint], st.dictionaries(st.text(max_size=3), of, max_size=3)),
        (
            list[dict[str, hint]],
            st.lists(st.dictionaries(st.text(max_size=3), of, max_size=2), max_size=2),
        ),
    ]


# A type hint and a value of it: a leaf of the table, or containers of them.
HINTED: list[tuple[Any, st.SearchStrategy[Any]]] = leaves + [
    case for hint, _ in leaves for case in _containers(hint)
]


@st.composite
def hinted(draw: st.DrawFn) -> tuple[Any, Any]:
    hint, values = draw(st.sampled_from(HINTED))
    return hint, draw(values)


@settings(max_examples=examples(300))
@given(hinted())
def test_any_value_comes_back_as_it_was_on_either_path_from_the_same_json(
    case: tuple[Any, Any],
) -> None:
    hint, value = case
    text = codec.dumps(value)
    for use in (True, False):
        decoded = codec.decoder(hint, pydantic=use).decode(json.loads(text))
        assert decoded == value, (use, text)
        assert codec.dumps(decoded) == text  # (byte for byte: the wire does not depend on it)


@settings(max_examples=examples(200))
@given(
    st.builds(
        Shipment,
        st.uuids(),
        st.datetimes(timezones=OFFSETS),
        st.lists(decimals),
        st.sampled_from(Colour),
        st.binary(),
        points,
        st.dictionaries(st.text(), st.text()),
    )
)
def test_dataclasses_of_the_table_come_back_on_either_path(value: Shipment) -> None:
    text = codec.dumps(value)
    pydantic_view = codec.decoder(Shipment, pydantic=True).decode(json.loads(text))
    standard_view = codec.decoder(Shipment, pydantic=False).decode(json.loads(text))
    assert pydantic_view == value == standard_view
    assert codec.dumps(pydantic_view) == text == codec.dumps(standard_view)


def test_the_flag_chooses_the_default_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # (pydantic is lax where the standard types are not: "5" is an int to it)
    monkeypatch.setattr(codec, "PYDANTIC", True)
    assert codec.decoder(int).decode("5") == 5
    monkeypatch.setattr(codec, "PYDANTIC", False)
    with pytest.raises(codec.DecodeError):
        codec.decoder(int).decode("5")
