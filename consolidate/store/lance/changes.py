"""What a commit writes: the pass's records compared with the stored rows, column by
column as arrays, and the difference of two versions."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..schema import (
    COLUMNS,
    Records,
)


def _same(a: pa.Array, b: pa.Array) -> pa.Array:
    """Row-wise equality of two Arrow columns of one type; two nulls (or two NaN) are equal;
    list columns compare by length and by their items joined."""
    if pa.types.is_list(a.type):
        la, lb = pc.list_value_length(a), pc.list_value_length(b)
        same_len = pc.fill_null(pc.equal(la, lb), False)
        ja = pc.binary_join(a, "\x1f")
        jb = pc.binary_join(b, "\x1f")
        return pc.and_(pc.or_(same_len, pc.and_(pc.is_null(a), pc.is_null(b))), _same(ja, jb))
    eq = pc.fill_null(pc.equal(a, b), False)
    both = pc.and_(pc.is_null(a), pc.is_null(b))
    if pa.types.is_floating(a.type):
        both = pc.or_(both, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    return pc.or_(eq, both)


def _vector_diff(
    final_vecs: np.ndarray,
    have: np.ndarray,
    sp: np.ndarray,
    parts: Sequence[np.ndarray],
    chunk: int = 65536,
) -> np.ndarray:
    """``bool [len(have)]``: whether row ``have[i]`` of ``final_vecs`` differs in any
    component from stored row ``sp[i]``, the stored vectors given in ``parts`` (``(m_k, d)``
    float32 each, stored rows in order).

    Rows that line up in runs (consecutive in both, within one part: what a pass that
    keeps its rows in order and purges some leaves) are compared as two slices per run of at
    most ``chunk`` rows, with no gather, and a run whose two slices are the same memory is
    not compared at all; the loop is per run, and where runs average fewer than 64 rows the
    rows are gathered in blocks of ``chunk`` instead."""
    diff = np.zeros(len(have), bool)
    if not len(have):
        return diff
    bounds = np.cumsum([0] + [len(v) for v in parts])
    part = np.searchsorted(bounds, sp, side="right") - 1
    brk = np.flatnonzero((np.diff(have) != 1) | (np.diff(sp) != 1) | (np.diff(part) != 0)) + 1
    starts = np.r_[0, brk]
    ends = np.r_[brk, len(have)]
    if len(starts) <= max(1, len(have) // 64):
        for s0, e0 in zip(starts.tolist(), ends.tolist(), strict=True):
            q = int(part[s0])
            for s in range(s0, e0, chunk):
                k = min(chunk, e0 - s)
                r0, a0 = int(have[s]), int(sp[s]) - int(bounds[q])
                f, v = final_vecs[r0 : r0 + k], parts[q][a0 : a0 + k]
                if (
                    f.__array_interface__["data"][0] != v.__array_interface__["data"][0]
                    or f.strides != v.strides
                ):  # the very same memory needs no compare
                    diff[s : s + k] = np.any(f != v, axis=1)
        return diff
    for s in range(0, len(have), chunk):
        rows, at, pt = have[s : s + chunk], sp[s : s + chunk], part[s : s + chunk]
        for q, vecs in enumerate(parts):
            sel = np.flatnonzero(pt == q)
            if len(sel):
                diff[s + sel] = np.any(final_vecs[rows[sel]] != vecs[at[sel] - bounds[q]], axis=1)
    return diff


def _column_equal(a: np.ndarray, b: np.ndarray, kind: str) -> np.ndarray:
    """Row-wise equality of one decoded column (``kind``: its :data:`COLUMNS` dtype); two
    missing values (None, NaN) are equal.

    Raises:
        TypeError, ValueError: the values do not compare as arrays (e.g. an item that is
            itself an array)."""
    if kind == "float64":
        a, b = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
        return (a == b) | (np.isnan(a) & np.isnan(b))
    if kind == "bool" and a.dtype == bool and b.dtype == bool:
        return a == b
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns, not raises, on some failed compares
        eq = np.asarray(a == b)
    if eq.dtype != bool or eq.shape != a.shape:
        raise TypeError("values that do not compare one to one")
    miss = np.flatnonzero(~eq)
    if len(miss):  # None == None is True already; NaN != NaN
        eq[miss] = pd.isna(a[miss]) & pd.isna(b[miss])
    return eq


def _diff(
    final: Records,
    frames: Sequence[pd.DataFrame],
    vectors: Sequence[np.ndarray],
    stored_ids: pa.ChunkedArray,
) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
    """Which rows of the new records differ from the stored rows, compared as decoded
    (the columns the load produced, kept in ``frames``), with row matching taken from
    ``final.origin`` (or, without it, from new records that begin with the stored rows in
    order); ``None`` where that does not hold or a column does not compare as arrays (the
    caller then compares as Arrow, :func:`_changes`).

    Every match is checked: the matched ids are equal, the stored positions distinct, and
    no id of an unmatched row is stored; then the result equals :func:`_changes`'s, without
    a hash join over all ids (``O(n)`` array operations).

    Args:
        final: the new records (``n`` rows, ``origin`` indexing the stored rows).
        frames: the stored rows' decoded columns in parts (``m_k`` rows each), in order.
        vectors: the stored rows' ``float32 (m_k, d)`` vectors, the same parts.
        stored_ids: the ``m`` stored ids (Arrow strings), in order.

    Returns:
        ``(upsert, dead, removed)``: ascending positions in ``final`` to write (new, or any
        column or vector component different), ascending stored positions whose rows are
        replaced or removed, and the removed (absent) stored ids.
    """
    m, n = sum(len(f) for f in frames), len(final)

    def col(c: str) -> np.ndarray:
        return (
            frames[0][c].to_numpy()
            if len(frames) == 1 or not len(frames[1])
            else np.concatenate([f[c].to_numpy() for f in frames])
        )

    f_ids, s_ids = final.meta["id"].to_numpy(object), col("id")
    matched = _matches(final.origin, f_ids, s_ids, stored_ids)
    if matched is None:
        return None
    have, sp, new = matched
    same = _same_columns(final, col, have, sp)
    if same is None:
        return None
    diff = ~same
    d = final.dim
    diff |= _vector_diff(
        final.vectors.reshape(n, d), have, sp, [v.reshape(len(v), d) for v in vectors]
    )
    kept = np.zeros(m, bool)
    kept[sp] = True
    gone = np.flatnonzero(~kept)
    upsert = np.sort(np.concatenate([new, have[diff]]))
    dead = np.sort(np.concatenate([sp[diff], gone]))
    return upsert, dead, s_ids[gone].tolist()


def _matches(
    origin: np.ndarray | None, f_ids: np.ndarray, s_ids: np.ndarray, stored_ids: pa.ChunkedArray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """For :func:`_diff`: ``(have, sp, new)``, the positions of the new rows matched to a
    stored row, their stored positions, and the positions of the unmatched (new) rows; or
    ``None`` when a match does not check (ids differ, a stored row matched twice) or an
    unmatched id is repeated, missing or stored."""
    m, n = len(s_ids), len(f_ids)
    o = origin
    if o is None:
        if n < m or not (f_ids[:m] == s_ids).all():
            return None
        o = np.r_[np.arange(m), np.full(n - m, -1)]
    ok = o >= 0
    have = np.flatnonzero(ok)
    sp = o[have]
    if len(sp):
        if sp.min() < 0 or sp.max() >= m:
            return None
        if not np.all(np.diff(sp) > 0) and np.bincount(sp, minlength=m).max() > 1:
            return None
        if not np.all(f_ids[have] == s_ids[sp]):
            return None
    new = np.flatnonzero(~ok)
    if len(new):
        new_ids = f_ids[new]
        try:
            nid = pa.array(new_ids, pa.string())
        except (pa.ArrowException, TypeError, ValueError):
            return None
        if (
            nid.null_count
            or pd.Series(new_ids).duplicated().any()
            or pc.any(pc.is_in(stored_ids, value_set=nid)).as_py()
        ):
            return None  # a repeated, missing or stored id: the Arrow path decides
    return have, sp, new


def _same_columns(
    final: Records, col: Callable[[str], np.ndarray], have: np.ndarray, sp: np.ndarray
) -> np.ndarray | None:
    """``bool [len(have)]``: every column but the id of the new rows ``have`` equals the
    stored rows ``sp``'s (``col(c)``: a stored column); ``None`` when a column does not
    compare as arrays."""
    k = len(have)
    # both exactly 0..k-1 (have is increasing by construction; sp must be too)
    straight = (
        k > 0
        and bool(np.all(np.diff(sp) > 0))
        and int(have[-1]) == k - 1
        and int(sp[0]) == 0
        and int(sp[-1]) == k - 1
    )
    same = np.ones(k, bool)
    try:
        for c, kind in COLUMNS.items():
            if c == "id":
                continue
            a, b = final.meta[c].to_numpy(), col(c)
            same &= (
                _column_equal(a[:k], b[:k], kind)
                if straight
                else _column_equal(a[have], b[sp], kind)
            )
    except (TypeError, ValueError, KeyError, Warning):
        return None
    return same


def _changes(
    final_meta: pa.Table,
    final_vecs: np.ndarray,
    stored_meta: pa.Table,
    stored_vecs: Sequence[np.ndarray],
    chunk: int = 65536,
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Which rows of the new records differ from the stored rows, and which stored ids are
    gone, compared as Arrow columns (a hash join over the ids where the rows do not line
    up); every comparison is an array operation (Arrow kernels, NumPy blocks).

    Args:
        final_meta: the new records' non-vector columns, ``n`` rows
            (:func:`~consolidate.store.schema.records_to_arrow` with ``with_vectors=False``).
        final_vecs: ``(n, d)`` float32, their vectors.
        stored_meta: the stored rows' non-vector columns (``m`` rows, unique ids), same
            schema.
        stored_vecs: the stored rows' decoded ``(m_i, d)`` float32 vectors in parts whose
            lengths sum to ``m``, in the order of ``stored_meta``.
        chunk: rows compared per block of vectors.

    Returns:
        ``(rows, removed, dead)``: ascending positions in the new records to upsert (a new
        id, or any column or vector component different), the stored ids absent from them,
        and the ascending stored positions whose rows are replaced or removed.
    """
    m = stored_meta.num_rows
    f_id, s_id = final_meta.column("id"), stored_meta.column("id")
    if final_meta.num_rows >= m and f_id.slice(0, m).equals(s_id):
        # the usual case: the stored rows first, in stored order, then new rows (no join)
        have = sp = np.arange(m)
        pos = np.concatenate([sp, np.full(final_meta.num_rows - m, -1)])
        aligned = True
    else:
        sid = s_id.to_numpy(zero_copy_only=False)
        pos = pd.Index(sid, dtype=object).get_indexer(f_id.to_numpy(zero_copy_only=False))
        have = np.flatnonzero(pos >= 0)
        sp = pos[have]
        aligned = False
    same = pa.array(np.ones(len(have), bool))
    if final_meta.schema.names != stored_meta.schema.names:
        same = pa.array(np.zeros(len(have), bool))
    else:
        fa, sa = pa.array(have), pa.array(sp)
        for c in final_meta.schema.names:
            if aligned:
                a, b = final_meta.column(c).slice(0, m), stored_meta.column(c)
            else:
                a = final_meta.column(c).take(fa)
                b = stored_meta.column(c).take(sa)
            if a.type != b.type:
                b = b.cast(a.type)
            same = pc.and_(same, _same(a.combine_chunks(), b.combine_chunks()))
    diff = ~same.to_numpy(zero_copy_only=False)
    if len(have):
        diff |= _vector_diff(final_vecs, have, sp, stored_vecs, chunk)
    upsert = np.sort(np.concatenate([np.flatnonzero(pos < 0), have[diff]]))
    if aligned:
        return upsert, [], np.sort(sp[diff])
    gone = np.ones(m, dtype=bool)
    gone[sp] = False
    return upsert, sid[gone].tolist(), np.sort(np.concatenate([sp[diff], np.flatnonzero(gone)]))
