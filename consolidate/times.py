"""One reader and one writer for the time columns of every source a user brings.

Inside the project a time is ``float64`` hours since the Unix epoch (UTC). Sources keep
times their own way: Arrow/Lance/Parquet timestamps of any unit with or without a time
zone, ISO 8601 text with or without an offset, Python ``datetime`` objects (psycopg, Mem0),
or epoch numbers whose unit only the user knows. :func:`hours_from_values` reads all of
them; :func:`values_from_hours` writes hours back in the column's own type and unit (and,
for text, in the style its existing values use), so a merged row looks like the rows
around it.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["EPOCH_UNITS", "TimeColumnError", "hours_from_values", "values_from_hours", "iso_style"]

#: seconds per unit of an epoch number (``h`` = the project's own hours)
EPOCH_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "h": 3600.0}
_ARROW_UNIT_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


class TimeColumnError(ValueError):
    """A time column that cannot be read: names the column (``what``) and the first bad
    value with its row."""


def _arrow(values: Any) -> pa.Array | pa.ChunkedArray | None:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
    return None


def hours_from_values(values: Any, *, what: str, unit: str | None = None) -> np.ndarray:
    """Times as hours since the epoch.

    Args:
        values: an Arrow array or chunked array, a pandas ``Series``, a NumPy array or a
            sequence. Understood: Arrow timestamps of any unit (a time zone or none: naive
            is UTC), Arrow ``date32``/``date64``, ``datetime64`` arrays, ``datetime`` and
            ``pd.Timestamp`` objects, ISO 8601 text (``2025-02-02T10:00:00``, with ``Z`` or
            ``+01:00``, or a date alone), and numbers when ``unit`` says what they count.
            Nulls, ``None``, NaN and empty text are missing.
        what: the column and source, for errors (``"events.lance: column 'ts'"``).
        unit: the unit of epoch numbers, one of :data:`EPOCH_UNITS` (``s``, ``ms``, ``us``,
            ``ns``, ``h``); ``None``: numbers are refused.

    Returns:
        ``float64 [n]`` hours since 1970-01-01T00:00Z, NaN where missing.

    Raises:
        TimeColumnError: text that is not ISO 8601, numbers without a ``unit``, an unknown
            unit, or a type that holds no time; the message names ``what`` and the row.
    """
    if unit is not None and unit not in EPOCH_UNITS:
        raise TimeColumnError(f"{what}: unknown time unit {unit!r} (one of {sorted(EPOCH_UNITS)})")
    arr = _arrow(values)
    if arr is not None:
        t = arr.type
        if pa.types.is_timestamp(t):
            n = pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False).astype(np.float64)
            return n * _ARROW_UNIT_S[t.unit] / 3600.0  # nulls come out NaN
        if pa.types.is_date32(t) or pa.types.is_date64(t):
            return hours_from_values(pc.cast(arr, pa.timestamp("s")), what=what)
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
            nums = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
            return _from_numbers(nums, what, unit)
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return _from_objects(arr.to_pylist(), what, unit)
        if pa.types.is_null(t):
            return np.full(len(arr), np.nan)
        raise TimeColumnError(
            f"{what} is {t}; times must be timestamps, dates, ISO 8601 text or epoch numbers "
            f"with a declared unit"
        )
    if isinstance(values, pd.Series):
        values = values.to_numpy()
    if isinstance(values, (list, tuple)):  # mixed items stay items (no common dtype)
        return _from_objects(list(values), what, unit)
    a = np.asarray(values) if not isinstance(values, np.ndarray) else values
    if a.ndim != 1:
        raise TimeColumnError(f"{what}: expected a column (one dimension), got shape {a.shape}")
    if a.dtype.kind == "M":
        us = a.astype("datetime64[us]").astype(np.int64).astype(np.float64)  # +-290k years
        return np.where(np.isnat(a), np.nan, us / 3.6e9)
    if a.dtype.kind in "iuf" and a.dtype != bool:
        return _from_numbers(a.astype(np.float64), what, unit)
    return _from_objects(list(a), what, unit)


def _from_numbers(nums: np.ndarray, what: str, unit: str | None) -> np.ndarray:
    if unit is None:
        finite = np.flatnonzero(np.isfinite(nums))
        if len(finite) == 0:
            return np.full(len(nums), np.nan)
        raise TimeColumnError(
            f"{what} holds numbers (row {int(finite[0])}: {float(nums[finite[0]])!r}); declare their "
            f"unit ({'|'.join(EPOCH_UNITS)}) or store timestamps or ISO 8601 text"
        )
    return nums.astype(np.float64) * EPOCH_UNITS[unit] / 3600.0


_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?(Z|[+-]\d{2}:?\d{2})?$")


def _from_objects(items: Sequence[Any], what: str, unit: str | None) -> np.ndarray:
    out = np.full(len(items), np.nan)
    for k, x in enumerate(items):  # only for object columns (text, datetime objects)
        if x is None or x is pd.NA or x is pd.NaT or (isinstance(x, str) and not x.strip()):
            continue
        if isinstance(x, (float, np.floating)) and np.isnan(x):
            continue
        if isinstance(x, bool):
            raise TimeColumnError(f"{what}: row {k}: {x!r} is not a time")
        if isinstance(x, (int, float, np.integer, np.floating)):
            out[k] = _from_numbers(np.array([float(x)]), f"{what}: row {k}", unit)[0]
            continue
        if isinstance(x, str):
            s = x.strip()
            if not _ISO.match(s):
                raise TimeColumnError(
                    f"{what}: row {k}: {x!r} is not ISO 8601 text (e.g. 2025-02-02T10:00:00, "
                    f"with Z or +01:00 for a zone; naive is UTC)"
                )
            x = s
        if isinstance(x, str):
            out[k] = _iso_hours(x, f"{what}: row {k}")
            continue
        if isinstance(x, np.datetime64):
            out[k] = hours_from_values(np.array([x]), what=what)[0]
            continue
        if isinstance(x, (_dt.datetime, _dt.date)):  # pd.Timestamp is a datetime
            if not isinstance(x, _dt.datetime):
                x = _dt.datetime(x.year, x.month, x.day)
            out[k] = _datetime_hours(x)
            continue
        raise TimeColumnError(f"{what}: row {k}: {x!r} ({type(x).__name__}) is not a time")
    return out


_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def _datetime_hours(x: _dt.datetime) -> float:
    """Hours since the epoch of a ``datetime`` (naive = UTC), for any year 1-9999, exact to
    the microsecond (Python's own arithmetic; pandas' nanoseconds end at 1677 and 2262)."""
    if x.tzinfo is None:
        x = x.replace(tzinfo=_dt.timezone.utc)
    d = x - _EPOCH
    return (d.days * 86400 + d.seconds) / 3600.0 + d.microseconds / 3.6e9


def _iso_hours(s: str, what: str) -> float:
    """Hours of ISO 8601 text already matched by :data:`_ISO` (any year 1-9999)."""
    t = s.replace(" ", "T", 1) if len(s) > 10 else s
    if t.endswith(("Z", "z")):
        t = t[:-1] + "+00:00"
    if len(t) > 16 and t[-5] in "+-" and t[-4:].isdigit():  # -0500 -> -05:00
        t = t[:-2] + ":" + t[-2:]
    try:
        return _datetime_hours(_dt.datetime.fromisoformat(t))
    except ValueError as e:
        raise TimeColumnError(f"{what}: {s!r} is not a time ({e})") from None


def iso_style(example: str | None) -> str:
    """How an existing ISO text writes its times: ``"offset"`` (``+00:00`` style), ``"z"``
    (a trailing ``Z``), or ``"naive"`` (no zone: read as UTC). ``None``: ``"offset"``."""
    if not example:
        return "offset"
    s = example.strip()
    if s.endswith("Z"):
        return "z"
    return "offset" if re.search(r"[+-]\d{2}:?\d{2}$", s) else "naive"


def values_from_hours(
    hours: Sequence[float] | np.ndarray,
    like: pa.DataType,
    *,
    unit: str | None = None,
    style: str = "offset",
) -> list[Any]:
    """Hours since the epoch as values of a column of type ``like`` (for
    ``pa.array(values, like)`` or a database driver).

    Args:
        hours: ``float64`` hours; NaN becomes ``None``.
        like: the column's Arrow type: a timestamp (its unit and zone kept; values that
            are not whole units of it are rounded to the nearest), text (ISO 8601 in
            ``style``: ``"offset"`` ``2025-02-02T10:00:00+00:00``, ``"z"``
            ``2025-02-02T10:00:00Z``, ``"naive"`` ``2025-02-02T10:00:00``; fractions of a
            second only where there are any), a date, or a number (``unit`` required).
        unit: the unit of a numeric column (see :data:`EPOCH_UNITS`).
        style: see ``like``; :func:`iso_style` reads it from an existing value.

    Raises:
        TimeColumnError: a numeric column without a ``unit``, or a type that holds no time.
    """
    h = np.asarray(hours, np.float64)
    if pa.types.is_timestamp(like):
        per_h = 3600.0 / _ARROW_UNIT_S[like.unit]
        ints = [None if not np.isfinite(x) else int(round(x * per_h)) for x in h]
        if any(i is not None and not -(2**63) < i < 2**63 for i in ints):
            raise TimeColumnError(f"a time is outside what a {like} column can hold")
        return pa.array(ints, pa.int64()).cast(like).to_pylist()
    if pa.types.is_date32(like) or pa.types.is_date64(like):
        return [
            None if not np.isfinite(x) else _dt.date(1970, 1, 1) + _dt.timedelta(hours=x) for x in h
        ]
    if pa.types.is_string(like) or pa.types.is_large_string(like):
        return [None if not np.isfinite(x) else _iso(x, style) for x in h]
    if pa.types.is_integer(like) or pa.types.is_floating(like):
        if unit is None or unit not in EPOCH_UNITS:
            raise TimeColumnError(f"a {like} time column needs its unit ({'|'.join(EPOCH_UNITS)})")
        scale = 3600.0 / EPOCH_UNITS[unit]
        if pa.types.is_integer(like):
            return [None if not np.isfinite(x) else int(round(x * scale)) for x in h]
        return [None if not np.isfinite(x) else float(x * scale) for x in h]
    raise TimeColumnError(f"a {like} column holds no times")


def _iso(h: float, style: str) -> str:
    try:  # to the nearest microsecond, any year 1-9999
        ts = _EPOCH + _dt.timedelta(microseconds=round(h * 3.6e9))
    except OverflowError:
        raise TimeColumnError(f"{h!r} hours since the epoch is outside the years 1-9999") from None
    spec = "seconds" if ts.microsecond == 0 else "microseconds"
    s = ts.replace(tzinfo=None).isoformat(timespec=spec)
    return s if style == "naive" else s + ("Z" if style == "z" else "+00:00")
