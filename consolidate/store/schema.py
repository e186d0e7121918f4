"""Record schema, conversion to and from Arrow, and validation.

In memory a set of records is a :class:`Records`: a pandas ``DataFrame`` of scalar and list
columns plus a row-aligned ``float32`` numpy array of unit vectors. Times are **hours since the
Unix epoch (UTC) as float64** in memory (``NaN`` = null) and ``timestamp[us, UTC]`` in Parquet.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..text import text_hashes, utf8_ok
from .vectors import SCALE_COLUMN, decode_vectors, empty_vectors, encode_vectors

__all__ = [
    "COLUMNS",
    "TIME_COLUMNS",
    "Records",
    "InvalidRecordsError",
    "Problem",
    "validate",
    "records_from_rows",
    "records_to_arrow",
    "records_from_arrow",
    "hours_now",
    "hours_from_datetime",
    "datetime_from_hours",
]

MERGED_ID_FORM = r"(?:m|rf)-[0-9a-f]{24}"
"""The reserved form of the ids passes give merged records (``m-``) and reflections
(``rf-``), :func:`consolidate.pipeline.merged_id`: appends may not take it."""

# name -> pandas dtype used in memory
COLUMNS: dict[str, str] = {
    "id": "object",
    "namespace": "object",
    "text": "object",
    "importance": "float64",
    "created_at": "float64",
    "last_used": "float64",
    "strength": "float64",
    "pinned": "bool",
    "source_ids": "object",
    "valid_from": "float64",
    "valid_to": "float64",
    "deleted_at": "float64",
    "deleted_reason": "object",
    "merged_into": "object",
    "text_hash": "object",
    "last_pass": "float64",  # version written by the first pass that kept it (null: unseen)
    "keep_apart": "object",  # ids this record must never be merged with (set by an undo)
    "derived_from": "object",  # ids of the memories a reflection summarises ([] otherwise)
}
TIME_COLUMNS = ("created_at", "last_used", "valid_from", "valid_to", "deleted_at")
_NULLABLE_STR = ("deleted_reason", "merged_into")
#: why a row is a tombstone: merged by a pass, updated/deleted/superseded by the write path,
#: dropped by the floor or the cap, an undone merged record
DELETED_REASONS = ("merged", "updated", "deleted", "superseded", "floor", "cap", "undone")
_US_PER_HOUR = 3_600_000_000


def hours_now() -> float:
    """Current wall-clock time in hours since the Unix epoch (UTC), float."""
    return time.time() / 3600.0


def hours_from_datetime(ts: Any) -> float:
    """Hours since the epoch for a ``datetime``/``pd.Timestamp``/ISO string (naive = UTC)."""
    t = pd.Timestamp(ts)
    if t.tzinfo is None:
        t = t.tz_localize("UTC")
    return t.value / 3.6e12


def datetime_from_hours(h: float) -> pd.Timestamp:
    """Inverse of :func:`hours_from_datetime` (UTC ``pd.Timestamp``)."""
    return pd.Timestamp(round(h * 3.6e12), unit="ns", tz="UTC")


@dataclass
class Records:
    """Row-aligned record table and vectors.

    Attributes:
        meta: ``DataFrame`` with exactly the columns of :data:`COLUMNS`, ``RangeIndex``.
        vectors: ``float32`` array ``[n, d]``; row ``k`` belongs to ``meta.iloc[k]``.
    """

    meta: pd.DataFrame
    vectors: np.ndarray
    #: rows whose vector had the wrong length on input (filled with NaN); see :func:`validate`
    bad_dim: list[int] = field(default_factory=list)
    #: rows whose text was not valid UTF-8 on input (text set to ``None``)
    bad_utf8: list[int] = field(default_factory=list)
    #: other input problems found while parsing rows: kind -> row positions
    input_problems: dict[str, list[int]] = field(default_factory=dict)
    #: ``int64 [n]`` or ``None``: per row, its position in the stored table it was read
    #: from (``-1``: a row written since). A hint a store sets at load and :meth:`take`,
    #: :meth:`concat` and the pass carry along, so a commit finds each row's stored row
    #: without a hash join over the ids; the store checks every hint against the ids and
    #: ignores wrong ones.
    origin: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.meta) != len(self.vectors):
            raise ValueError(f"meta has {len(self.meta)} rows but vectors {len(self.vectors)}")
        # positions and labels must agree (the pass mixes .iat and .loc)
        if not self.meta.index.equals(pd.RangeIndex(len(self.meta))):
            self.meta = self.meta.reset_index(drop=True)
        if self.origin is not None:
            o = np.asarray(self.origin)
            self.origin = (
                o.astype(np.int64, copy=False)
                if o.shape == (len(self.meta),) and o.dtype.kind in "iu"
                else None
            )

    def __len__(self) -> int:
        return len(self.meta)

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1]) if self.vectors.ndim == 2 else 0

    def take(self, idx: np.ndarray | list[int]) -> Records:
        """Rows ``idx`` (int positions) as new ``Records``."""
        idx = np.asarray(idx, dtype=np.int64)
        return Records(
            self.meta.iloc[idx].reset_index(drop=True),
            self.vectors[idx],
            origin=None if self.origin is None else self.origin[idx],
        )

    def mask(self, m: np.ndarray) -> Records:
        return self.take(np.flatnonzero(m))

    @staticmethod
    def concat(parts: Iterable[Records], dim: int) -> Records:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Records.empty(dim)
        meta = pd.concat([p.meta for p in parts], ignore_index=True)
        origin = None
        if any(p.origin is not None for p in parts):
            origin = np.concatenate(
                [p.origin if p.origin is not None else np.full(len(p), -1, np.int64) for p in parts]
            )
        return Records(
            meta, np.concatenate([p.vectors for p in parts]).astype(np.float32), origin=origin
        )

    @staticmethod
    def empty(dim: int) -> Records:
        meta = pd.DataFrame({c: pd.Series([], dtype=t) for c, t in COLUMNS.items()})
        return Records(meta, np.zeros((0, dim), dtype=np.float32))

    def live_mask(self) -> np.ndarray:
        """``bool [n]``: rows that are not tombstones."""
        return np.isnan(self.meta["deleted_at"].to_numpy(dtype=np.float64))


class InvalidRecordsError(ValueError):
    """Records failed validation. ``problems`` lists each kind with the offending ids."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = [f"invalid records in {source}:"]
        lines += [f"  - {p.describe()}" for p in problems]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled by its arguments (a fleet run sends it from a worker to the driver)
        return (type(self), (self.source, self.problems))


@dataclass
class Problem:
    """One kind of invalid input found by :func:`validate`, with the rows and ids that have
    it; :meth:`describe` names the first few."""

    kind: str
    rows: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def describe(self, show: int = 5) -> str:
        head = ", ".join(repr(i) for i in self.ids[:show])
        more = f" (and {len(self.ids) - show} more)" if len(self.ids) > show else ""
        return f"{self.kind}: {len(self.ids)} record(s): {head}{more}"


_REAL = (int, float, np.integer, np.floating)
#: times outside +-2e6 hours of the epoch (about years 1742..2198) are refused
MAX_ABS_HOURS = 2e6
MAX_STRENGTH = 1e6
#: a memory is a fact, not a document: longer texts are refused at write and at load
MAX_TEXT_CHARS = 100_000
#: strength never exceeds this through recalls or merges unless a caller sets another cap
#: (the pass's ``strength_cap`` default and :meth:`Store.mark_used`'s): without a cap, early
#: memories recalled often would outlive everything (the rich-get-richer pitfall)
DEFAULT_STRENGTH_CAP = 20.0


def _is_real(v: Any) -> bool:
    return isinstance(v, _REAL) and not isinstance(v, (bool, np.bool_))


def _to_hours(v: Any) -> float:
    """None/NaT/NaN -> NaN; a real number -> hours; datetime/Timestamp/ISO str -> hours."""
    if v is None:
        return math.nan
    if _is_real(v):
        return float(v)
    if isinstance(v, (bool, np.bool_)):
        raise TypeError("a boolean is not a time")
    if pd.isna(v):
        return math.nan
    from ..times import hours_from_values  # the one reader of every source's times

    return float(hours_from_values([v], what="time", unit="h")[0])


class _RowParser:
    """Parses one input row; problems are collected per kind instead of raised."""

    def __init__(self, now_h: float) -> None:
        self.now_h = now_h
        self.problems: dict[str, list[int]] = {}

    def bad(self, kind: str, k: int) -> None:
        self.problems.setdefault(kind, []).append(k)

    def parse(self, row: Mapping[str, Any], k: int) -> dict[str, Any]:
        """Row ``k`` as record fields; each problem is reported (:meth:`bad`) and the field
        gets a value the later checks refuse or a neutral default."""
        if not isinstance(row, Mapping):
            self.bad(f"record is a {type(row).__name__}, not a mapping", k)
            row = {}
        r: dict[str, Any] = {}
        for req in ("id", "namespace", "text", "vector"):
            if req not in row:
                self.bad(f"missing field {req!r}", k)
        for c in ("id", "namespace"):
            v = row.get(c)
            r[c] = v if isinstance(v, str) else (None if v is None else str(v))
            if v is not None and not isinstance(v, str):
                self.bad(f"{c} is not a string", k)
        r["text"] = row.get("text")
        for c, default in (("importance", 0.5), ("strength", 1.0)):
            v = row.get(c, default)
            r[c] = float(v) if _is_real(v) else math.nan
            if not _is_real(v):
                self.bad(f"{c} is not a number", k)
        self._times(row, r, k)
        p = row.get("pinned", False)
        if not isinstance(p, (bool, np.bool_)):
            self.bad("pinned is not a boolean", k)
        r["pinned"] = bool(p) if isinstance(p, (bool, np.bool_)) else False
        r["source_ids"] = self._strings(row, "source_ids", k)
        for c in _NULLABLE_STR:
            v = row.get(c)
            r[c] = v if isinstance(v, str) else None
            if v is not None and not isinstance(v, str):
                self.bad(f"{c} is not a string", k)
        lp = row.get("last_pass")
        r["last_pass"] = float(lp) if lp is not None and _is_real(lp) else math.nan
        for c in ("keep_apart", "derived_from"):
            r[c] = self._strings(row, c, k)
        return r

    def _strings(self, row: Mapping[str, Any], c: str, k: int) -> list[str]:
        """List column ``c`` of row ``k`` (missing or null: empty); one that is not a list
        of strings is reported and empty."""
        v = row.get(c)
        v = [] if v is None else v
        if (
            isinstance(v, (str, bytes))
            or not isinstance(v, (list, tuple, np.ndarray))
            or not all(isinstance(x, str) for x in v)
        ):
            self.bad(f"{c} is not a list of strings", k)
            return []
        return list(v)

    def _times(self, row: Mapping[str, Any], r: dict[str, Any], k: int) -> None:
        """The time columns of row ``k`` as hours (``created_at`` and ``last_used`` stand in
        for each other, then the reader's clock); one that is no time is reported, NaN."""
        for c in TIME_COLUMNS:
            v = row.get(c)
            if c == "created_at" and v is None:
                v = row.get("last_used", self.now_h)
            if c == "last_used" and v is None:
                v = row.get("created_at", self.now_h)
            try:
                r[c] = _to_hours(v)
            except (ValueError, TypeError, OverflowError):
                r[c] = math.nan
                self.bad(f"{c} is not a time", k)


def records_from_rows(rows: Iterable[Mapping[str, Any]], dim: int | None = None) -> Records:
    """Build :class:`Records` from dicts with at least ``id``, ``namespace``, ``text``, ``vector``.

    Times may be hours since the epoch (int or float), ``datetime``, ``pd.Timestamp`` or ISO
    strings (naive = UTC); ``None``/NaT = missing. Missing optional fields get defaults:
    importance 0.5, strength 1, last_used = created_at = now, no provenance. ``text_hash`` is
    always recomputed. Nothing is coerced silently: a field of the wrong type (a string
    importance, a string ``source_ids``, a non-boolean ``pinned``, a vector that is not a
    flat list of numbers of length ``dim``) is recorded in ``Records.input_problems`` and
    reported by :func:`validate` with the record's id.

    Args:
        rows: iterable of mappings.
        dim: expected vector dimension; default: the length of the first row's vector.
    """
    parser = _RowParser(hours_now())
    raw = list(rows)
    parsed = [parser.parse(r, k) for k, r in enumerate(raw)]
    vec_in = [r.get("vector") if isinstance(r, Mapping) else None for r in raw]
    arrays: list[np.ndarray | None] = []
    for k, v in enumerate(vec_in):
        try:
            if isinstance(v, (list, tuple)) and bool in set(map(type, v)):
                raise ValueError  # JSON true/false is no vector component
            if isinstance(v, np.ndarray) and v.dtype == np.bool_:
                raise ValueError
            a = np.asarray(v, dtype=np.float32)
            if a.ndim != 1 or isinstance(v, (str, bytes)):
                raise ValueError
            arrays.append(a)
        except (ValueError, TypeError):
            arrays.append(None)
            if v is not None:
                parser.bad("vector is not a flat list of numbers", k)
    if dim is None:
        dim = next((len(a) for a in arrays if a is not None), 0)
    vecs = np.full((len(raw), dim), np.nan, dtype=np.float32)
    bad_dim = []
    for k, got in enumerate(arrays):
        if got is None:
            continue
        if got.shape[0] != dim:
            bad_dim.append(k)
        else:
            vecs[k] = got
    meta = pd.DataFrame(
        {
            c: pd.Series([r.get(c) for r in parsed], dtype=object)
            for c in COLUMNS
            if c != "text_hash"
        }
    )
    meta["text_hash"] = text_hashes(meta["text"].tolist())
    meta = _coerce(meta)
    return Records(meta, vecs, bad_dim=bad_dim, input_problems=parser.problems)


def _coerce(meta: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame(index=pd.RangeIndex(len(meta)))
    for c in COLUMNS:
        s = meta[c] if c in meta else pd.Series([None] * len(meta))
        out[c] = _coerce_column(c, s)
    return out


def _coerce_column(c: str, s: pd.Series) -> Any:
    """Column ``c`` of any values in its in-memory dtype (:data:`COLUMNS`): numbers that do
    not parse become NaN, a missing list ``[]``, a missing flag ``False``."""
    t = COLUMNS[c]
    if t == "float64":
        return pd.to_numeric(s, errors="coerce").astype("float64").to_numpy()
    if t == "bool":
        return s.fillna(False).astype(bool).to_numpy()
    if c in _LIST_COLUMNS:  # anything that is not a list stays as it is: validation names it
        return pd.Series(
            [
                list(x)
                if isinstance(x, (list, tuple, np.ndarray))
                else []
                if x is None or x is pd.NA
                else x
                for x in s
            ],
            dtype=object,
        )
    return pd.Series(list(s), dtype=object)


_LIST_COLUMNS = ("source_ids", "keep_apart", "derived_from")


def _arrow_column(c: str, arr: pa.ChunkedArray) -> Any:
    """Column ``c`` of a snapshot table in its in-memory dtype, with array operations when
    ``arr`` has the snapshot schema's type (any other type goes through
    :func:`_coerce_column`; a time column that does not cast to a timestamp raises
    ``pyarrow.ArrowInvalid``)."""
    t = COLUMNS[c]
    typ = arr.type
    if c in TIME_COLUMNS:
        us = arr.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
        v = us.to_numpy(zero_copy_only=False).astype(np.float64) / _US_PER_HOUR
        v[np.asarray(us.is_null())] = np.nan
        return v
    if t == "float64" and (pa.types.is_floating(typ) or pa.types.is_integer(typ)):
        return arr.cast(pa.float64()).to_numpy(zero_copy_only=False)  # null -> NaN
    if t == "bool" and pa.types.is_boolean(typ):
        return pc.fill_null(arr, False).to_numpy(zero_copy_only=False).astype(bool)
    if c in _LIST_COLUMNS and pa.types.is_list(typ) and pa.types.is_string(typ.value_type):
        return pd.Series(_frozen_lists(arr), dtype=object)
    if c == "namespace" and pa.types.is_string(typ) and not arr.null_count:
        # few distinct values: one Python string per namespace, shared by its rows
        enc = (
            arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
        ).dictionary_encode()
        names = np.asarray(enc.dictionary.to_pylist() + [None], dtype=object)[:-1]
        return pd.Series(names[enc.indices.to_numpy(zero_copy_only=False)], dtype=object)
    if t == "object" and pa.types.is_string(typ):
        return pd.Series(arr.to_numpy(zero_copy_only=False), dtype=object)
    return _coerce_column(c, pd.Series(arr.to_pylist(), dtype=object))


class FrozenList(list):
    """A list-of-strings cell of records read from a store (``source_ids``, ``keep_apart``,
    ``derived_from``): equal to, and used like, the ``list`` it holds, but it refuses
    in-place changes. Pandas copies a table's columns on write, not the lists inside its
    cells, so a list changed in place would change every table that shares it, among them
    the snapshot a store compares its commit with: assign a new list instead.

    Raises:
        TypeError: on ``append``, ``extend``, item assignment and every other in-place
            change.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "a record's list cell cannot be changed in place (it is shared "
            "with the snapshot it was read from): assign a new list instead"
        )

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenList, (list(self),))


#: the empty cell, shared by every row whose list is empty (it cannot change)
_EMPTY = FrozenList()


def _frozen_lists(arr: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """``object [n]`` of :class:`FrozenList` from a list-of-strings column (null = empty):
    one shared empty cell, a new cell only for the rows that hold items."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    out = np.empty(len(arr), dtype=object)
    out.fill(_EMPTY)
    full = np.flatnonzero(np.asarray(pc.fill_null(pc.list_value_length(arr), 0)) > 0)
    if len(full):
        vals = arr.take(pa.array(full)).to_pylist()
        out[full] = np.fromiter((FrozenList(v) for v in vals), dtype=object, count=len(vals))
    return out


# ---------------------------------------------------------------- arrow I/O
def arrow_schema(dim: int, vector_dtype: str = "fp32") -> pa.Schema:
    """Parquet/Arrow schema of a snapshot with ``dim``-dimensional vectors stored in
    ``vector_dtype`` (see :mod:`consolidate.store.vectors`; int8 adds ``vector_scale``)."""
    ts = pa.timestamp("us", tz="UTC")
    vec = encode_vectors(np.zeros((0, dim), np.float32), vector_dtype)
    return pa.schema(
        [
            ("id", pa.string()),
            ("namespace", pa.string()),
            ("text", pa.string()),
            *[(name, col.type) for name, col in sorted(vec.items())],
            ("importance", pa.float64()),
            ("created_at", ts),
            ("last_used", ts),
            ("strength", pa.float64()),
            ("pinned", pa.bool_()),
            ("source_ids", pa.list_(pa.string())),
            ("valid_from", ts),
            ("valid_to", ts),
            ("deleted_at", ts),
            ("deleted_reason", pa.string()),
            ("merged_into", pa.string()),
            ("text_hash", pa.string()),
            ("last_pass", pa.int64()),
            ("keep_apart", pa.list_(pa.string())),
            ("derived_from", pa.list_(pa.string())),
        ]
    )


def _hours_to_ts(col: np.ndarray) -> pa.Array:
    mask = np.isnan(col)
    us = np.where(mask, 0, np.round(col * _US_PER_HOUR)).astype(np.int64)
    return pa.array(us, type=pa.int64(), mask=mask).cast(pa.timestamp("us", tz="UTC"))


def _opt_str(s: pd.Series) -> pa.Array:
    """A string column: ``str`` values kept, anything else (None, NaN, a number) null.
    Arrow converts a column of strings and missing values in one call; only a column that
    holds something else is walked in Python."""
    try:
        return pa.array(s.to_numpy(object), pa.string(), from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError):
        return pa.array([x if isinstance(x, str) else None for x in s], pa.string())


def _str_lists(s: pd.Series) -> pa.Array:
    """A list-of-strings column (lists, tuples or arrays of ``str``) in one Arrow call, or
    item by item where Arrow refuses the column as it is."""
    t = pa.list_(pa.string())
    try:
        return pa.array(s.to_numpy(object), t, from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError):
        return pa.array([list(x) for x in s], t)


def records_to_arrow(
    recs: Records, vector_dtype: str = "fp32", *, with_vectors: bool = True
) -> pa.Table:
    """Convert to an Arrow table with :func:`arrow_schema` (times as UTC timestamps), the
    vectors stored in ``vector_dtype`` (``with_vectors=False``: the other columns only).

    Raises:
        ValueError: an unknown ``vector_dtype``, or NaN/inf in a vector stored as int8.
    """
    m = recs.meta
    dim = recs.dim
    arrays = {
        "id": _opt_str(m["id"]),
        "namespace": _opt_str(m["namespace"]),
        "text": _opt_str(m["text"]),
        **(
            encode_vectors(recs.vectors.reshape(len(recs), dim), vector_dtype)
            if with_vectors
            else {}
        ),
        "importance": pa.array(m["importance"].to_numpy(np.float64)),
        "strength": pa.array(m["strength"].to_numpy(np.float64)),
        "pinned": pa.array(m["pinned"].to_numpy(bool)),
        "source_ids": _str_lists(m["source_ids"]),
        "keep_apart": _str_lists(m["keep_apart"]),
        "derived_from": _str_lists(m["derived_from"]),
        "deleted_reason": _opt_str(m["deleted_reason"]),
        "merged_into": _opt_str(m["merged_into"]),
        "text_hash": _opt_str(m["text_hash"]),
    }
    for c in TIME_COLUMNS:
        arrays[c] = _hours_to_ts(m[c].to_numpy(np.float64))
    lp = m["last_pass"].to_numpy(np.float64)
    lp_mask = np.isnan(lp)
    arrays["last_pass"] = pa.array(np.where(lp_mask, 0, lp).astype(np.int64), mask=lp_mask)
    schema = arrow_schema(dim, vector_dtype)
    if not with_vectors:
        schema = pa.schema([f for f in schema if f.name in arrays])
    return pa.table([arrays[f.name] for f in schema], schema=schema)


def _decode_texts(col: pa.ChunkedArray) -> tuple[list[str | None], list[int]]:
    """Python strings of a string/binary column; rows with invalid UTF-8 become ``None``."""
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        try:
            for chunk in col.chunks:
                chunk.validate(full=True)
            return col.to_pylist(), []
        except pa.ArrowInvalid:
            col = pa.chunked_array([c.view(pa.binary()) for c in col.chunks], pa.binary())
    out: list[str | None] = []
    bad: list[int] = []
    for k, b in enumerate(col.to_pylist()):
        if b is None or isinstance(b, str):
            out.append(b)
            continue
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
            bad.append(k)
    return out, bad


def records_from_arrow(
    table: pa.Table,
    dim: int | None = None,
    *,
    stored_hashes: bool = False,
    vectors: np.ndarray | None = None,
) -> Records:
    """Inverse of :func:`records_to_arrow`. ``text_hash`` is recomputed from the text,
    unless ``stored_hashes`` (a table this package wrote, e.g. a Lance store's): then the
    stored column is used and only its missing values are computed. Rows with invalid
    UTF-8 text get text ``None``
    and are listed in ``Records.bad_utf8`` for :func:`validate`; vectors of the wrong length
    (variable-length list columns) in ``Records.bad_dim``. A fixed-size vector column in any
    stored dtype is decoded to float32 (:func:`~consolidate.store.vectors.decode_vectors`).

    Args:
        table: snapshot or delta table.
        dim: expected vector dimension (default: the fixed list size, or the most common
            length of a variable-length vector column).
        vectors: the rows' vectors already decoded, ``float32 [n, dim]`` (used as they
            are, not copied); ``table`` then needs no vector column.

    Raises:
        KeyError: a required column (id, namespace, text, vector) is missing.
        ValueError: a fixed-size vector column of a type no storage dtype uses, int8
            vectors without their ``vector_scale`` column, or ``vectors`` of another shape
            or dtype.
    """
    names = set(table.column_names)
    for req in ("id", "namespace", "text", *(("vector",) if vectors is None else ())):
        if req not in names:
            raise KeyError(f"column {req!r} missing (columns: {sorted(names)})")
    texts, bad_utf8 = _decode_texts(table.column("text"))
    n = table.num_rows
    bad_dim: list[int] = []
    if vectors is not None:
        if (
            vectors.dtype != np.float32
            or vectors.ndim != 2
            or vectors.shape[0] != n
            or (dim is not None and vectors.shape[1] != dim)
        ):
            raise ValueError(
                f"vectors of shape {vectors.shape} and dtype {vectors.dtype} "
                f"for {n} rows of dimension {dim}: float32 [n, dim] expected"
            )
        vecs = vectors
    else:
        vecs, bad_dim, dim = _vectors_of(table, names, n, dim)
    meta = pd.DataFrame(index=pd.RangeIndex(n))
    for c in COLUMNS:
        if c == "text":
            meta[c] = pd.Series(texts, dtype=object)
        elif c == "text_hash":
            meta[c] = pd.Series(_hashes(table, texts, stored_hashes), dtype=object)
        elif c in names:
            meta[c] = _arrow_column(c, table.column(c))
        else:
            meta[c] = _coerce_column(c, pd.Series([None] * n, dtype=object))
    return Records(meta, vecs, bad_dim=bad_dim, bad_utf8=bad_utf8)


def _vectors_of(
    table: pa.Table, names: set[str], n: int, dim: int | None
) -> tuple[np.ndarray, list[int], int]:
    """``(float32 [n, dim] vectors, rows of the wrong length, dim)`` of a table's vector
    column (see :func:`records_from_arrow`)."""
    col = table.column("vector")
    if pa.types.is_fixed_size_list(col.type) and dim in (None, col.type.list_size):
        # decoded chunk by chunk into one array: peak memory is the output plus a chunk
        dim = col.type.list_size
        vecs = empty_vectors(n, dim)
        scale = table.column(SCALE_COLUMN) if SCALE_COLUMN in names else None
        at = 0
        for chunk in col.chunks:
            k = len(chunk)
            vecs[at : at + k] = decode_vectors(chunk, None if scale is None else scale.slice(at, k))
            at += k
        return vecs, [], dim
    vcol = col.combine_chunks()
    vt = getattr(vcol.type, "value_type", None)
    if vt is None or not pa.types.is_floating(vt) or vt == pa.float16() or SCALE_COLUMN in names:
        # int8 codes or bf16 bits in a variable-length list (a round trip through
        # pandas) would decode as raw integers: refuse rather than guess
        raise ValueError(
            f"vector column of type {vcol.type} is not a stored vector column: vectors "
            f"are fixed-size lists, or variable-length lists of float32/float64 (int8 and "
            f"bf16 need their fixed-size type and int8 its {SCALE_COLUMN!r})"
        )
    lists = vcol.to_pylist()
    lens = [len(v) if v is not None else -1 for v in lists]
    if dim is None:
        dim = max(sorted(set(lens)), key=lens.count) if lens else 0
    vecs = np.full((n, dim), np.nan, dtype=np.float32)
    bad_dim = []
    for k, v in enumerate(lists):
        if v is None or len(v) != dim:
            bad_dim.append(k)
        else:
            vecs[k] = v
    return vecs, bad_dim, dim


def _hashes(table: pa.Table, texts: list[str | None], stored: bool) -> list[str]:
    """``text_hash`` per row: the stored column's values where ``stored`` and present,
    computed from the text otherwise."""
    if not stored or "text_hash" not in table.column_names:
        return text_hashes(texts)
    col = table.column("text_hash")
    out = col.to_pylist()
    missing = np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))
    if len(missing):
        for k, h in zip(missing, text_hashes([texts[k] for k in missing]), strict=True):
            out[k] = h
    return out


# ---------------------------------------------------------------- validation
def validate(
    recs: Records,
    *,
    dim: int | None,
    now_h: float | None = None,
    future_tolerance_h: float = 5 / 60,
    existing_ids: set[str] | None = None,
) -> list[Problem]:
    """Check every record; return the problems found (empty list = valid).

    Checks: NaN/inf in a vector, zero vector, wrong dimension, empty or whitespace-only text,
    text longer than :data:`MAX_TEXT_CHARS` characters, text that is not valid UTF-8,
    duplicate id (within ``recs`` and against ``existing_ids``), importance outside [0, 1]
    (or NaN), strength < 1 (or NaN), ``created_at``, ``last_used`` or ``deleted_at`` later
    than ``now_h + future_tolerance_h``, list columns that are not lists of strings, a
    ``deleted_reason`` outside :data:`DELETED_REASONS`, and a missing id or namespace.

    Args:
        recs: the records.
        dim: expected vector dimension (``None`` = take ``recs.dim``).
        now_h: wall clock in hours since the epoch (default: now).
        future_tolerance_h: allowed clock skew for times in the future, hours (default
            5 min).
        existing_ids: ids already in the store (for duplicate detection at write time).

    Returns:
        list of :class:`Problem`, one per kind that occurs, ids in row order.
    """
    now_h = hours_now() if now_h is None else now_h
    m = recs.meta
    ids = [str(x) for x in m["id"]]
    found: dict[str, list[int]] = {}
    checks = itertools.chain(
        recs.input_problems.items(),
        _identity_problems(m),
        _vector_problems(recs, dim),
        _text_problems(recs),
        _number_problems(m, now_h + future_tolerance_h),
    )
    for kind, rows in checks:
        rows = sorted(set(int(r) for r in rows))
        if rows:
            found.setdefault(kind, []).extend(rows)
    id_index = pd.Index(ids, dtype=object)
    dup = id_index.duplicated(keep="first")
    if existing_ids:
        dup |= id_index.isin(existing_ids)
    if dup.any():
        found.setdefault("duplicate id", []).extend(np.flatnonzero(dup).tolist())
    return [Problem(kind, rows, [ids[r] for r in rows]) for kind, rows in found.items()]


_Found = Iterator[tuple[str, Iterable[int]]]


def _identity_problems(m: pd.DataFrame) -> _Found:
    """:func:`validate`'s checks of the list columns, ids and namespaces."""
    yield (
        "source_ids, keep_apart or derived_from is not a list of strings",
        np.unique(np.concatenate([_not_str_lists(m[c]) for c in _LIST_COLUMNS])),
    )
    id_arr, ns_arr = _str_column(m["id"]), _str_column(m["namespace"])
    yield "id is missing or empty", _blank_or_missing(m["id"], id_arr)
    yield "namespace is missing or empty", _blank_or_missing(m["namespace"], ns_arr)
    if id_arr is None or ns_arr is None or not _all_utf8_lists(m["source_ids"]):
        yield (
            "id, namespace or source_ids not valid UTF-8",
            [
                k
                for k, (i, n, src) in enumerate(
                    zip(m["id"], m["namespace"], m["source_ids"], strict=True)
                )
                if not all(utf8_ok(x) for x in [i, n, *src] if isinstance(x, str))
            ],
        )


def _vector_problems(recs: Records, dim: int | None) -> _Found:
    """:func:`validate`'s checks of the vectors: dimension, NaN or inf, zero."""
    v = recs.vectors
    bad_dim = set(recs.bad_dim)
    if dim is not None and v.ndim == 2 and v.shape[1] != dim:
        bad_dim = set(range(len(recs)))
    yield "wrong vector dimension" + (f" (expected {dim})" if dim else ""), bad_dim
    if v.size:
        with np.errstate(invalid="ignore", over="ignore"):
            sq = np.einsum("ij,ij->i", v, v, dtype=np.float64)
        # a row's float64 sum of squares is finite exactly when every float32 component is
        # (each square is below 1.2e77): no [n, d] temporary
        finite = np.isfinite(sq)
        yield "NaN or inf in vector", [int(k) for k in np.flatnonzero(~finite) if k not in bad_dim]
        yield "zero vector", np.flatnonzero(finite & (sq < 1e-24))


def _text_problems(recs: Records) -> _Found:
    """:func:`validate`'s checks of the texts: UTF-8, blank, too long."""
    m = recs.meta
    bad_utf8 = set(recs.bad_utf8)
    text_arr = _str_column(m["text"])
    if text_arr is None:
        for k, t in enumerate(m["text"]):
            if isinstance(t, str) and not utf8_ok(t):
                bad_utf8.add(k)
    yield "text is not valid UTF-8", bad_utf8
    yield (
        "empty or whitespace-only text",
        [k for k in _blank_or_missing(m["text"], text_arr) if k not in bad_utf8],
    )
    if text_arr is not None:
        long_ = np.flatnonzero(
            np.asarray(
                pc.fill_null(pc.greater(pc.utf8_length(text_arr), MAX_TEXT_CHARS), False),
                dtype=bool,
            )
        )
    else:
        long_ = np.array(
            [k for k, t in enumerate(m["text"]) if isinstance(t, str) and len(t) > MAX_TEXT_CHARS],
            dtype=np.int64,
        )
    yield f"text longer than {MAX_TEXT_CHARS:,} characters", long_


def _number_problems(m: pd.DataFrame, latest_h: float) -> _Found:
    """:func:`validate`'s checks of the numbers: importance, strength, times (none after
    ``latest_h`` among the transaction times), ``deleted_reason``."""
    imp = m["importance"].to_numpy(np.float64)
    yield "importance outside [0, 1]", np.flatnonzero(~((imp >= 0) & (imp <= 1)))
    st = m["strength"].to_numpy(np.float64)
    yield "strength < 1", np.flatnonzero(~(st >= 1))
    yield f"strength above {MAX_STRENGTH:g}", np.flatnonzero(st > MAX_STRENGTH)
    # transaction times cannot lie ahead of the clock (valid_from/valid_to are valid time:
    # when a fact holds in the world, which may be ahead of today)
    for c in ("created_at", "last_used", "deleted_at"):
        yield f"{c} in the future", np.flatnonzero(m[c].to_numpy(np.float64) > latest_h)
    for c in ("created_at", "last_used"):
        yield f"{c} missing", np.flatnonzero(np.isnan(m[c].to_numpy(np.float64)))
    for c in TIME_COLUMNS:
        t = m[c].to_numpy(np.float64)
        yield (
            f"{c} out of range (|hours since epoch| > {MAX_ABS_HOURS:g})",
            np.flatnonzero(~np.isnan(t) & ~(np.abs(t) <= MAX_ABS_HOURS)),
        )
    reason = m["deleted_reason"]
    yield (
        f"deleted_reason not one of {', '.join(DELETED_REASONS)}",
        np.flatnonzero((reason.notna() & ~reason.isin(DELETED_REASONS)).to_numpy(bool)),
    )


# every character for which str.isspace() holds (Python 3.11, Unicode 14)
_SPACE_SUPERSET = (
    "^[\\x{9}-\\x{d}\\x{1c}-\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}"
    "\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}]*$"
)


def _str_column(s: pd.Series) -> pa.Array | None:
    """``s`` as an Arrow string array (null for None/NaN) when every other value is a
    ``str`` encodable as UTF-8; ``None`` otherwise (the caller checks value by value)."""
    vals = s.to_numpy(object)
    if len(vals) and pd.api.types.infer_dtype(vals, skipna=True) not in ("string", "empty"):
        return None
    try:
        return pa.array(vals, pa.string(), from_pandas=True)
    except (UnicodeEncodeError, pa.ArrowException):
        return None


def _blank_or_missing(s: pd.Series, arr: pa.Array | None) -> np.ndarray:
    """Rows of ``s`` that are not a ``str`` or hold only whitespace (``str.strip`` empties
    them): candidates by one RE2 match over ``arr`` (see :func:`_str_column`), each
    confirmed in Python."""
    vals = s.to_numpy(object)
    if arr is None:
        cand = np.arange(len(vals))
    else:
        blank = pc.match_substring_regex(arr, _SPACE_SUPERSET)
        cand = np.flatnonzero(np.asarray(pc.fill_null(blank, True), dtype=bool))
    return np.asarray(
        [k for k in cand.tolist() if not isinstance(vals[k], str) or not vals[k].strip()], np.int64
    )


def _not_str_lists(s: pd.Series) -> np.ndarray:
    """Rows of a list column whose value is not a ``list`` of ``str`` (an int or a None
    inside, a bare string): one type map over the rows and one Arrow conversion, with a
    value-by-value pass only when that conversion fails."""
    vals = s.to_numpy(object)
    types = np.fromiter(map(type, vals), object, len(vals))  # C-level map, no bytecode
    not_list = ~(
        np.equal(types, np.array(list, dtype=object)).astype(bool)
        | np.equal(types, np.array(FrozenList, dtype=object)).astype(bool)
    )
    ok = np.flatnonzero(~not_list)
    try:
        arr = pa.array(vals[ok], pa.list_(pa.string()))
        flat = pc.list_flatten(arr)
        null_rows = (
            ok[np.unique(pc.list_parent_indices(arr).filter(flat.is_null()))]
            if flat.null_count
            else np.zeros(0, np.int64)
        )
        bad = np.union1d(np.flatnonzero(not_list), null_rows)
    except (pa.ArrowException, TypeError, ValueError, UnicodeEncodeError):
        bad = np.flatnonzero(
            not_list
            | np.fromiter(
                (
                    not all(isinstance(x, str) for x in v) if isinstance(v, list) else True
                    for v in vals
                ),
                bool,
                len(vals),
            )
        )  # FrozenList is a list
    return bad.astype(np.int64)


def _all_utf8_lists(s: pd.Series) -> bool:
    """Whether every element of the list column ``s`` is a list of UTF-8-encodable strings
    (one Arrow conversion; ``False`` sends the caller to the value-by-value check)."""
    try:
        pa.array(s.to_numpy(object), pa.list_(pa.string()), from_pandas=True)
    except (UnicodeEncodeError, pa.ArrowException):
        return False
    return True


def normalise_vectors(recs: Records) -> None:
    """Rescale every finite non-zero vector to unit length in place (float32)."""
    v = recs.vectors.astype(np.float64)
    n = np.linalg.norm(v, axis=1, keepdims=True)
    ok = np.isfinite(n) & (n > 1e-12)
    v = np.where(ok, v / np.where(ok, n, 1.0), v)
    recs.vectors = v.astype(np.float32)
