"""The one time reader and writer of every source (consolidate.times), on one table of
inputs: each form of 2025-02-02T10:00:00Z must read as the same hours since the epoch."""

import datetime as dt

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from consolidate.times import TimeColumnError, hours_from_values, iso_style, values_from_hours

#: 2025-02-02T10:00:00Z, hours since the epoch (1738490400 s / 3600)
H = 1738490400 / 3600
S = 1738490400

#: (input, unit): every form a source may hold the same instant in
SAME_INSTANT = [
    (pa.array(["2025-02-02T10:00:00"]), None),
    (pa.array(["2025-02-02 10:00:00"]), None),
    (pa.array(["2025-02-02T10:00:00Z"]), None),
    (pa.array(["2025-02-02T11:00:00+01:00"]), None),
    (pa.array(["2025-02-02T05:00:00-0500"]), None),
    (pa.array([S], pa.timestamp("s")), None),
    (pa.array([S * 1000], pa.timestamp("ms", tz="UTC")), None),
    (pa.array([S * 10**6], pa.timestamp("us", tz="Europe/Berlin")), None),
    (pa.array([S * 10**9], pa.timestamp("ns")), None),
    (pa.array([S]), "s"),
    (pa.array([S * 1000]), "ms"),
    (pa.array([float(H)]), "h"),
    ([dt.datetime(2025, 2, 2, 10)], None),
    ([dt.datetime(2025, 2, 2, 11, tzinfo=dt.timezone(dt.timedelta(hours=1)))], None),
    ([pd.Timestamp("2025-02-02T10:00Z")], None),
    (np.array(["2025-02-02T10:00"], "datetime64[m]"), None),
    (pd.Series(pd.to_datetime(["2025-02-02T10:00:00"], utc=True)), None),
    (pd.Series(pd.to_datetime(["2025-02-02T10:00:00"]).as_unit("us")), None),
]


@pytest.mark.parametrize("values,unit", SAME_INSTANT)
def test_every_form_reads_as_the_same_hours(values, unit):
    assert hours_from_values(values, what="t", unit=unit).tolist() == [H]


def test_missing_values_and_dates():
    got = hours_from_values(pa.array([None, "", "2025-02-02"], pa.string()), what="t")
    assert np.isnan(got[0]) and np.isnan(got[1]) and got[2] == H - 10
    d = hours_from_values(pa.array([dt.date(2025, 2, 2)], pa.date32()), what="t")
    assert d.tolist() == [H - 10]
    ts = hours_from_values(pa.array([None, S], pa.timestamp("s")), what="t")
    assert np.isnan(ts[0]) and ts[1] == H


@pytest.mark.parametrize(
    "values,unit,match",
    [
        (pa.array([5.0]), None, r"^t\.lance: column 'ts' holds numbers \(row 0: 5\.0\); declare"),
        (pa.array(["02/02/2025"]), None, r"row 0: '02/02/2025' is not ISO 8601"),
        (pa.array(["2025-02-02", "soon"]), None, r"row 1: 'soon' is not ISO 8601"),
        (pa.array([True]), None, r"is bool"),
        (pa.array([1]), "minutes", r"unknown time unit 'minutes'"),
    ],
)
def test_what_cannot_be_read_is_named(values, unit, match):
    with pytest.raises(TimeColumnError, match=match):
        hours_from_values(values, what="t.lance: column 'ts'", unit=unit)


@pytest.mark.parametrize(
    "like,unit,style,want",
    [
        (pa.string(), None, "naive", "2025-02-02T10:00:00"),
        (pa.string(), None, "offset", "2025-02-02T10:00:00+00:00"),
        (pa.string(), None, "z", "2025-02-02T10:00:00Z"),
        (pa.int64(), "s", "offset", S),
        (pa.int64(), "ms", "offset", S * 1000),
        (pa.float64(), "h", "offset", H),
    ],
)
def test_written_in_the_columns_own_type(like, unit, style, want):
    (got,) = values_from_hours([H], like, unit=unit, style=style)
    assert got == want
    # and read back to the same hours
    assert hours_from_values(pa.array([got], like), what="t", unit=unit).tolist() == [H]


def test_timestamps_keep_their_unit_and_zone():
    for t in (pa.timestamp("ms"), pa.timestamp("us", tz="UTC"), pa.timestamp("s", tz="Asia/Tokyo")):
        vals = values_from_hours([H, np.nan], t)
        assert vals[1] is None
        arr = pa.array(vals, t)
        assert arr.type == t and hours_from_values(arr, what="t").tolist()[0] == H
    with pytest.raises(TimeColumnError, match="needs its unit"):
        values_from_hours([H], pa.int64())
    assert iso_style("2025-02-02T10:00:00") == "naive" and iso_style("2025-02-02T10:00Z") == "z"
    assert iso_style("2025-02-02T10:00:00+01:00") == "offset" and iso_style(None) == "offset"
    # fractions of a second only where there are any
    assert values_from_hours([H + 0.5 / 3600], pa.string(), style="naive") == [
        "2025-02-02T10:00:00.500000"
    ]


def test_any_year_and_exact_round_trips():
    """Years 1 and 9999 (outside pandas' nanosecond range), mixed lists, missing values of
    every kind, and text written back to the second it was read."""
    year1 = -17259888.0  # 0001-01-01T00:00Z: 719162 days before the epoch
    got = hours_from_values(["0001-01-01T00:00:00", dt.datetime(1, 1, 1)], what="t")
    assert got.tolist() == [year1, year1]
    assert hours_from_values(np.array(["0001-01-01"], "datetime64[D]"), what="t").tolist() == [
        year1
    ]
    assert values_from_hours([year1], pa.string(), style="naive") == ["0001-01-01T00:00:00"]
    with pytest.raises(TimeColumnError, match="outside what a timestamp"):
        values_from_hours([year1], pa.timestamp("ns"))
    mixed = hours_from_values(
        [float("nan"), "2025-02-02T10:00:00", S, None, pd.NA], what="t", unit="s"
    )
    assert np.isnan(mixed[[0, 3, 4]]).all() and mixed[1] == mixed[2] == H
    texts = [f"20{y:02d}-07-20T00:00:{s:02d}Z" for y in (3, 30, 99) for s in range(60)]
    h = hours_from_values(texts, what="t")
    assert values_from_hours(h, pa.string(), style="z") == texts
