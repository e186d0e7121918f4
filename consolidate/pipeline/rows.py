"""One constructor for the records a pass writes (merged records and reflections)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from ..store.schema import COLUMNS
from ..text import text_hashes
from .state import PassState, group_sums, list_lengths, nan_reduce, segment_centroids

__all__ = ["new_records"]


def _union(lists: Sequence[Sequence[str]]) -> list[str]:
    """Sorted union of string lists."""
    out: set[str] = set()
    for lst in lists:
        out.update(lst)
    return sorted(out)


def _unions(col: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> list[list[str]]:
    """:func:`_union` of the lists of ``col`` (``object [n]`` of lists) over each group of
    ``rows`` (groups start at ``starts``); only groups holding a non-empty list are visited
    (most have none)."""
    k = len(starts)
    total = np.add.reduceat(list_lengths(col[rows]), starts) if len(rows) else np.zeros(k)
    out: list[list[str]] = [[] for _ in range(k)]
    ends = np.r_[starts[1:], len(rows)]
    for g in np.flatnonzero(total > 0).tolist():
        out[g] = _union(col[rows[starts[g] : ends[g]]])
    return out


def _merge_columns(
    st: PassState,
    rows: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    strength: np.ndarray,
    strength_cap: float,
) -> dict[str, Any]:
    """The columns of merged records that depend on the kind (see :func:`new_records`):
    strength, validity and the unions of ``keep_apart`` and ``derived_from``, for the groups
    of ``rows`` starting at ``starts`` (``strength``: the rows' strengths)."""
    vt = st.col("valid_to")[rows]
    any_open = np.add.reduceat(np.isnan(vt).astype(np.int64), starts) > 0
    w_sum = group_sums(strength, sizes)
    w_max = np.maximum.reduceat(strength, starts)
    return {
        "strength": np.minimum(w_sum, np.maximum(strength_cap, w_max)),
        "valid_from": nan_reduce(st.col("valid_from")[rows], starts, "max"),
        "valid_to": np.where(any_open, np.nan, np.maximum.reduceat(vt, starts)),
        "keep_apart": pd.Series(
            _unions(st.meta["keep_apart"].to_numpy(object), rows, starts), dtype=object
        ),
        "derived_from": pd.Series(
            _unions(st.meta["derived_from"].to_numpy(object), rows, starts), dtype=object
        ),
    }


def _text_hashes(texts: Sequence[str], known: Sequence[str | None] | None) -> list[str]:
    """:func:`~consolidate.text.text_hashes` of ``texts``, taken from ``known`` where it
    holds one (same length as ``texts``) and computed for the rest."""
    if known is None:
        return text_hashes(list(texts))
    if len(known) != len(texts):
        raise ValueError(f"{len(known)} text hashes for {len(texts)} texts")
    todo = [k for k, h in enumerate(known) if h is None]
    out = list(known)
    for k, h in zip(todo, text_hashes([texts[k] for k in todo]), strict=True):
        out[k] = h
    return out  # type: ignore[return-value]


def _centroids(
    st: PassState, rows: np.ndarray, seg: np.ndarray, k: int, strength: np.ndarray
) -> torch.Tensor:
    """:func:`~consolidate.pipeline.state.segment_centroids` of the table's rows ``rows``:
    read block by block from the snapshot's vectors when every row is a snapshot row (no
    gathered copy of the members' vectors), else from a gather that includes rows the pass
    wrote."""
    if int(rows.max()) < st.vec.shape[0]:
        return segment_centroids(st.vec, rows, seg, k, strength)
    return segment_centroids(st.vectors(rows), np.arange(len(rows)), seg, k, strength)


def new_records(
    st: PassState,
    groups: Sequence[np.ndarray],
    texts: Sequence[str],
    ids: Sequence[str],
    *,
    kind: Literal["merge", "reflection"],
    version: int,
    strength_cap: float = 20.0,
    hashes: Sequence[str | None] | None = None,
) -> tuple[pd.DataFrame, torch.Tensor]:
    """Rows (store columns) and vectors of new records, one per group of snapshot rows.

    Every new record gets the strength-weighted centroid of its group's vectors
    (renormalised, float64 sums on the pass device), importance = max, last_used = max,
    ``source_ids`` = union, ``text_hash`` of its text, ``last_pass = version``. Then by kind:

    * ``"merge"``: created_at = max (a merged record is as new as its newest fact, so no
      later fact it holds looks older), strength = sum capped at ``max(strength_cap, max)``,
      validity: ``valid_from`` = the latest stated (no later fact looks true earlier than
      it became), ``valid_to`` = latest, open if any member is open; ``keep_apart`` and
      ``derived_from`` = unions.
    * ``"reflection"``: created_at = max, strength 1, no validity, ``derived_from`` = the
      members' ids (in group order).

    Args:
        st: the pass state (reads its columns as they are now, e.g. after supersedes).
        groups: ``int64`` row positions per new record (snapshot rows, in id order).
        texts, ids: text and id of each new record.
        kind: ``"merge"`` or ``"reflection"``.
        version: the snapshot version the pass writes.
        strength_cap: cap on merged strength.
        hashes: each text's ``text_hash`` where the caller has it (``None``: computed).

    Returns:
        ``(meta, vectors)``: a ``DataFrame`` with the store's columns and ``float32 [k, d]``
        vectors on the pass device.
    """
    k = len(groups)
    if not k:
        return pd.DataFrame({c: pd.Series([], dtype=t) for c, t in COLUMNS.items()}), torch.zeros(
            (0, st.vec.shape[1]), dtype=torch.float32, device=st.vec.device
        )
    sizes = np.fromiter(map(len, groups), np.int64, k)
    rows = np.concatenate(groups).astype(np.int64)
    seg = np.repeat(np.arange(k), sizes)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    strength = st.col("strength")[rows]
    vec = _centroids(st, rows, seg, k, strength)
    cols: dict[str, Any] = {
        "id": pd.Series(list(ids), dtype=object),
        "namespace": pd.Series(st.meta["namespace"].to_numpy(object)[rows[starts]], dtype=object),
        "text": pd.Series(list(texts), dtype=object),
        "importance": np.maximum.reduceat(st.col("importance")[rows], starts),
        "created_at": np.maximum.reduceat(st.col("created_at")[rows], starts),
        "last_used": np.maximum.reduceat(st.col("last_used")[rows], starts),
        "pinned": np.zeros(k, bool),
        "source_ids": pd.Series(
            _unions(st.meta["source_ids"].to_numpy(object), rows, starts), dtype=object
        ),
        "deleted_at": np.full(k, np.nan),
        "deleted_reason": pd.Series([None] * k, dtype=object),
        "merged_into": pd.Series([None] * k, dtype=object),
        "text_hash": pd.Series(_text_hashes(texts, hashes), dtype=object),
        "last_pass": np.full(k, float(version)),
    }
    if kind == "merge":
        cols.update(_merge_columns(st, rows, starts, sizes, strength, strength_cap))
    else:
        cols.update(
            strength=np.ones(k),
            valid_from=np.full(k, np.nan),
            valid_to=np.full(k, np.nan),
            keep_apart=pd.Series([[] for _ in range(k)], dtype=object),
            derived_from=pd.Series(
                [list(st.meta["id"].to_numpy(object)[g]) for g in groups], dtype=object
            ),
        )
    meta = pd.DataFrame({c: cols[c] for c in COLUMNS})
    return meta, vec
