"""Reading a Lance dataset's rows into records: streamed scans, variable-width vector
columns, and rows with invalid UTF-8 named by id instead of failing the whole read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..schema import (
    Problem,
    Records,
    records_to_arrow,
)
from ..vectors import SCALE_COLUMN, decode_vectors, empty_vectors
from .dataset import SCAN_BATCH, log


@dataclass
class _Stored:
    """The rows of a snapshot as stored, before its pending deltas: what a commit of the
    snapshot compares the pass's records against.

    Attributes:
        ids: the ``m`` stored ids as read (Arrow strings).
        frame: the rows decoded (:func:`records_from_arrow`'s columns; a copy-on-write
            view of the loaded records' table, so later changes to the records never show
            here).
        vectors: ``float32 [m, d]``, read-only.
        rowaddr: ``uint64 [m]`` Lance row addresses (fragment id << 32 | offset) in the
            version read, or ``None`` when unknown.
    """

    ids: pa.ChunkedArray
    frame: pd.DataFrame
    vectors: np.ndarray
    rowaddr: np.ndarray | None = None

    def arrow(self) -> pa.Table:
        """The rows' non-vector columns as Arrow (:func:`records_to_arrow`)."""
        return records_to_arrow(Records(self.frame, self.vectors), with_vectors=False)


def _read_table(ds: Any, **kw: Any) -> tuple[pa.Table, bool]:
    """``(ds.scanner(**kw).to_table(), whether the scalar indexes served it)``. A filtered read that
    fails while one that ignores the indexes succeeds means an index file is damaged: the
    indexes are derived data (the rows are intact), so the read goes on without them, with
    a warning naming the way to rebuild them (:meth:`LanceStore.reindex`).

    Raises:
        the first read's error when the read without indexes fails too.
    """
    try:
        return ds.scanner(**kw).to_table(), True
    except Exception as e:
        if kw.get("filter") is None:
            raise
        try:
            out = ds.scanner(**kw, use_scalar_index=False).to_table()
        except Exception:
            raise e from None
        log.warning(
            "%s: a scalar index (under _indices) cannot be read (%s); reading "
            "without it, slower. The rows are intact; `consolidate-versions "
            "action=reindex` rebuilds the indexes",
            ds.uri,
            e,
        )
        return out, False


def _variable_width(vtype: pa.DataType) -> bool:
    """A vector column written by another tool as a list of floats of any length."""
    return (pa.types.is_list(vtype) or pa.types.is_large_list(vtype)) and pa.types.is_floating(
        vtype.value_type
    )


def _decode_variable(column: Any, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(float32 [n, dim] vectors, int64 [n] widths)`` of a list-of-floats column: rows
    of another width than ``dim`` (or null) get the first unit vector and their width (-1
    for null) is reported, so the caller refuses them by record."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(col)
    widths = pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False)
    widths = widths.astype(np.int64)
    out = np.zeros((n, dim), np.float32)
    out[:, 0] = 1.0
    ok = widths == dim
    if ok.any():
        good = col.filter(pa.array(ok))
        out[ok] = (
            pc.list_flatten(good).to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim)
        )
    return out, widths


def _scan(
    ds: Any,
    flt: Any,
    dim: int,
    found: Callable[[np.ndarray], None] | None = None,
    widths_out: dict[int, int] | None = None,
) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Read the rows of the Lance dataset ``ds`` that match ``flt`` (all when ``None``):
    first every column but the vectors, then the vectors batch by batch (:data:`SCAN_BATCH`
    rows) decoded into one ``float32`` array allocated up front. Two scans, because the
    other columns of a batch Lance returns share buffers with its vectors: kept, they
    would keep every batch's vectors alive. Peak memory: the output plus one batch.

    Args:
        found: called with the ``uint64`` row addresses once the first scan has them
            (before the vectors are read), or ``None``.
        widths_out: for a vector column of variable width (a list of floats, as another
            writer may leave it; with ``widths_out`` given, else refused), filled with
            ``{position: width}`` of each row that is not ``dim`` wide (-1: null); those
            rows get a placeholder vector, for the caller to refuse by record.

    Returns:
        ``(meta, vectors, rowaddr)``: the non-vector columns (Arrow, in scan order), the
        ``float32 [n, dim]`` vectors and the ``uint64 [n]`` row addresses, row-aligned.

    Raises:
        ValueError: the vector column is not ``dim`` wide, or the two scans disagree on the
            rows.
        OSError, pyarrow.ArrowException: Lance could not read a file.
    """
    vcols = [c for c in ("vector", SCALE_COLUMN) if c in ds.schema.names]
    vtype = ds.schema.field("vector").type
    variable = widths_out is not None and _variable_width(vtype) and SCALE_COLUMN not in vcols
    if not variable and (not pa.types.is_fixed_size_list(vtype) or vtype.list_size != dim):
        raise ValueError(f"the vector column is {vtype}, not {dim} wide")
    meta, indexed = _read_table(
        ds,
        columns=[c for c in ds.schema.names if c not in vcols],
        filter=flt,
        with_row_address=True,
    )
    addr = meta.column("_rowaddr").to_numpy()
    meta = meta.drop_columns(["_rowaddr"])
    n = len(addr)
    if found is not None:
        found(addr)
    vecs = empty_vectors(n, dim)
    order = None  # stored positions by address, built only if the scans' orders differ
    at = 0
    # Lance's default read-ahead holds about 1.3 GB of pages over a 10^6 x 384 fp32 scan;
    # one fragment at a time with 32 MiB of I/O buffer holds about half that, as fast
    for b in ds.to_batches(
        columns=vcols,
        filter=flt,
        with_row_address=True,
        batch_size=SCAN_BATCH,
        fragment_readahead=1,
        io_buffer_size=32 << 20,
        use_scalar_index=indexed,
    ):
        k = b.num_rows
        got = b.column("_rowaddr").to_numpy()
        if variable:
            block, widths = _decode_variable(b.column("vector"), dim)
        else:
            block = decode_vectors(
                b.column("vector"), b.column(SCALE_COLUMN) if SCALE_COLUMN in vcols else None
            )
        pos, order = _batch_rows(got, addr, at, order)
        vecs[pos] = block
        if variable:
            assert widths_out is not None
            wrong = np.flatnonzero(widths != dim)
            rows = np.arange(pos.start, pos.stop) if isinstance(pos, slice) else pos
            widths_out.update(zip(rows[wrong].tolist(), widths[wrong].tolist(), strict=True))
        at += k
    if at != n:
        raise ValueError(f"the vector scan returned {at} rows, the first {n}")
    return meta, vecs, addr


def _is_utf8_error(e: BaseException) -> bool:
    m = str(e).lower()
    return "utf-8" in m or "utf8" in m


def _string_field(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and _string_field(t.value_type))
    )


#: rows read per ``take`` while looking for the rows whose strings Lance cannot decode
_UTF8_CHUNK = 8192


def _batch_rows(
    got: np.ndarray, addr: np.ndarray, at: int, order: np.ndarray | None
) -> tuple[slice | np.ndarray, np.ndarray | None]:
    """Where a vector batch with row addresses ``got`` goes among the first scan's rows
    (addresses ``addr``; ``at`` rows placed so far): the next ``len(got)`` rows when the
    scans agree (a slice), else the rows found by address (``order``: ``addr``'s sort
    order, built on first need and returned for the next batches).

    Raises:
        ValueError: an address the first scan did not return.
    """
    n, k = len(addr), len(got)
    if at + k <= n and np.array_equal(got, addr[at : at + k]):
        return slice(at, at + k), order
    if order is None:
        order = np.argsort(addr, kind="stable")
    j = np.searchsorted(addr, got, sorter=order)
    if at + k > n or np.any(j >= n) or np.any(addr[order[np.minimum(j, n - 1)]] != got):
        raise ValueError(f"the vector scan returned rows the first scan of {n} rows did not")
    return order[j], order


def _scan_past_bad_strings(
    ds: Any, flt: Any, dim: int, widths_out: dict[int, int]
) -> tuple[pa.Table, np.ndarray, np.ndarray, dict[int, list[str]]]:
    """:func:`_scan` for a dataset with strings Lance refuses to decode (invalid UTF-8
    written by another tool): each string column that fails is read in chunks by position,
    and a chunk that fails is halved down to the single rows that hold the bad bytes.

    Returns:
        ``(meta, vectors, rowaddr, bad)`` as :func:`_scan`, filtered by ``flt`` after the
        read, and ``bad``: ``{position: [columns]}`` of the rows whose strings could not be
        decoded (their cells hold a placeholder: ``""``, or for ``id`` the row's position,
        so the caller refuses them by record).

    Raises:
        OSError, pyarrow.ArrowException: a read fails for another reason than the strings.
    """
    names = ds.schema.names
    strings = [f.name for f in ds.schema if _string_field(f.type)]
    base = ds.to_table(columns=[c for c in names if c not in strings], with_row_address=True)
    n = base.num_rows
    bad: dict[int, list[str]] = {}
    cols: dict[str, pa.Array | pa.ChunkedArray] = {}
    for c in strings:
        try:
            cols[c] = ds.to_table(columns=[c]).column(c)
            continue
        except Exception as e:  # noqa: BLE001 - only UTF-8 failures are looked into
            if not _is_utf8_error(e):
                raise
        ftype = ds.schema.field(c).type
        values: list[Any] = [None] * n
        todo = [(lo, min(lo + _UTF8_CHUNK, n)) for lo in range(0, n, _UTF8_CHUNK)]
        while todo:
            lo, hi = todo.pop()
            try:
                values[lo:hi] = ds.take(list(range(lo, hi)), columns=[c]).column(c).to_pylist()
            except Exception as e:  # noqa: BLE001
                if not _is_utf8_error(e):
                    raise
                if hi - lo == 1:
                    bad.setdefault(lo, []).append(c)
                    values[lo] = (
                        f"<row {lo}: not UTF-8>"
                        if c == "id"
                        else (
                            []
                            if pa.types.is_list(ftype) or pa.types.is_large_list(ftype)
                            else "\ufffd"
                        )
                    )
                else:
                    mid = (lo + hi) // 2
                    todo += [(lo, mid), (mid, hi)]
        cols[c] = pa.array(values, ftype)
    addr = base.column("_rowaddr").to_numpy()
    vtype = ds.schema.field("vector").type
    if _variable_width(vtype) and SCALE_COLUMN not in names:
        vecs, widths = _decode_variable(base.column("vector"), dim)
        wrong = np.flatnonzero(widths != dim)
        widths_out.update(zip(wrong.tolist(), widths[wrong].tolist(), strict=True))
    elif pa.types.is_fixed_size_list(vtype) and vtype.list_size == dim:
        vecs = decode_vectors(
            base.column("vector"), base.column(SCALE_COLUMN) if SCALE_COLUMN in names else None
        )
    else:
        raise ValueError(f"the vector column is {vtype}, not {dim} wide")
    vcols = {"vector", SCALE_COLUMN, "_rowaddr"}
    meta = pa.table({c: cols[c] if c in cols else base.column(c) for c in names if c not in vcols})
    if flt is not None:
        where = pa.table({"_pos": pa.array(np.arange(n)), "namespace": meta.column("namespace")})
        mask = np.asarray(where.filter(flt).column("_pos").to_numpy(), np.int64)
        remap = {int(p): k for k, p in enumerate(mask)}
        bad = {remap[p]: c for p, c in bad.items() if p in remap}
        moved = {remap[p]: w for p, w in widths_out.items() if p in remap}
        widths_out.clear()
        widths_out.update(moved)
        meta, vecs, addr = meta.take(pa.array(mask)), vecs[mask], addr[mask]
    return meta, vecs, addr, bad


def _row_problems(
    meta: pa.Table, widths: Mapping[int, int], bad: Mapping[int, list[str]], dim: int
) -> list[Problem]:
    """One :class:`Problem` per wrong vector width and per column of undecodable strings,
    naming the rows (positions in ``meta``) and their ids."""
    if not widths and not bad:
        return []
    ids = meta.column("id").to_pylist()
    groups: dict[str, list[int]] = {}
    for pos, w in sorted(widths.items()):
        what = "a null vector" if w < 0 else f"a vector of {w} components"
        groups.setdefault(f"{what}, the store's dim is {dim}", []).append(pos)
    for pos, cs in sorted(bad.items()):
        for c in cs:
            groups.setdefault(f"{c} is not valid UTF-8", []).append(pos)
    return [Problem(k, rows, [str(ids[r]) for r in rows]) for k, rows in groups.items()]
