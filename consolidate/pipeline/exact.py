"""Stage 2, exact duplicates: open, unpinned rows with one normalised-text hash in one
namespace form a unit (no model call); every other candidate row is a unit of its own."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..config import PassConfig
from .state import PassState, Units, group_sums, key_order, segment_centroids

__all__ = ["exact_stage", "open_facts", "hash_codes"]


def open_facts(st: PassState) -> tuple[np.ndarray, np.ndarray]:
    """``(open, closed)`` as ``bool [n]`` over the snapshot rows. ``closed``: the validity
    interval ended at or before the row's "now" (history). ``open``: live, not closed, not
    a reflection (a reflection's vector is its members' centroid, closer to each member than
    they are to each other): the rows that may be merged or reflected on."""
    vt = st.col("valid_to")
    closed = np.isfinite(vt) & (vt <= st.now)
    reflection = st.nonempty("derived_from")
    return st.live() & ~closed & ~reflection, closed


def exact_stage(st: PassState, cfg: PassConfig) -> PassState:
    """Group the candidate rows into :class:`~consolidate.pipeline.state.Units`.

    Candidates are open, unpinned rows (:func:`open_facts`). With ``cfg.exact_dedup`` rows
    of one namespace and one ``text_hash`` form one unit (a vectorised group-by on integer
    codes); a group holding two rows that an undo marked ``keep_apart`` is split first fit
    in id order (only such groups are visited in Python). A unit's vector is the
    strength-weighted centroid of its rows (float64 sums on the pass device).

    Sets ``st.units`` and the stats ``records_in``-side counts ``closed_kept_apart``,
    ``exact_groups``, ``exact_duplicates``.
    """
    ok, closed = open_facts(st)
    st.stats.closed_kept_apart = int((st.live() & closed).sum())
    cand = np.flatnonzero(ok & ~st.col("pinned").astype(bool))
    ns, rank = st.ns[cand], st.id_rank[cand]
    if cfg.exact_dedup and len(cand):
        h = hash_codes(st.meta["text_hash"].to_numpy(object)[cand])
        order = key_order(ns, h, rank)
        rows = cand[order]
        hs, nss = h[order], ns[order]
        brk = np.r_[True, (hs[1:] != hs[:-1]) | (nss[1:] != nss[:-1])]
        start = np.flatnonzero(brk)
        rows, start = _split_apart(st, rows, start)
    else:
        rows = cand[key_order(ns, rank)]
        start = np.arange(len(rows))
    bounds = np.r_[start, len(rows)]
    # units by (namespace, lowest id): each namespace contiguous for the similarity engine
    first = rows[start]
    uorder = key_order(st.ns[first], st.id_rank[first])
    size = np.diff(bounds)[uorder]
    rows = rows[_ranges(bounds[:-1][uorder], size)]
    ustart = np.r_[0, np.cumsum(size)].astype(np.int64)
    seg = np.repeat(np.arange(len(size)), size)
    strength = st.col("strength")
    weight = group_sums(strength[rows], size)
    vec = _unit_vectors(st, rows, ustart, seg, size, strength)
    st.units = Units(rows=rows, start=ustart, ns=st.ns[rows[ustart[:-1]]], vec=vec, weight=weight)
    multi = size > 1
    st.stats.exact_groups = int(multi.sum())
    st.stats.exact_duplicates = int((size[multi] - 1).sum())
    return st


#: each byte's value as a hexadecimal digit (255: not one)
_HEX_DIGIT = np.full(256, 255, np.uint8)
_HEX_DIGIT[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16)
_HEX_DIGIT[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def hash_codes(values: np.ndarray) -> np.ndarray:
    """``int64 [n]`` codes of ``values`` (``object [n]``, the ``text_hash`` column): equal
    codes for equal values and only for them.

    Hashes written by :func:`~consolidate.text.text_hashes` begin with 16 hexadecimal digits;
    those 64 bits are each value's integer key (0.22 s against 0.5 s for ``pd.factorize`` of
    980,000 hashes on the 2-core machine). Values whose keys tie are compared whole, so a
    tie of two different values (or values that do not begin with 16 hexadecimal digits,
    or that are not strings) falls back to ``pd.factorize``; the codes then differ, the
    partition into equal values does not."""
    values = np.asarray(values, dtype=object)
    n = len(values)
    try:
        head = values.astype("S16")  # ASCII, cut to 16 bytes
    except (UnicodeError, TypeError, ValueError):
        head = None
    if head is not None and n:
        digit = _HEX_DIGIT[head.view(np.uint8).reshape(n, 16)]
        if not (digit == 255).any():  # short values are padded with NUL: not a digit
            key = np.ascontiguousarray((digit[:, 0::2] << 4) | digit[:, 1::2]).view(">u8")
            key = key.ravel()
            order = np.argsort(key)
            tie = key[order[1:]] == key[order[:-1]]
            a, b = order[1:][tie], order[:-1][tie]
            if (values[a] == values[b]).all():
                codes = np.empty(n, np.int64)
                codes[order] = np.cumsum(np.r_[True, ~tie]) - 1
                return codes
    return pd.factorize(values)[0].astype(np.int64)


def _unit_vectors(
    st: PassState,
    rows: np.ndarray,
    ustart: np.ndarray,
    seg: np.ndarray,
    size: np.ndarray,
    strength: np.ndarray,
) -> torch.Tensor:
    """``float32 [U, d]``: a one-row unit's stored vector as it is (so the pass's pairs are
    those of the stored vectors), a group's strength-weighted centroid
    (:func:`~consolidate.pipeline.state.segment_centroids`)."""
    dev = st.vec.device
    idx = torch.from_numpy(rows[ustart[:-1]]).to(dev)
    if dev.type == "cpu":
        small = st.spare is None or st.spare.shape[0] < st.n + len(size)
        if st.first_touch is not None and (st.first_touch.writes or small):
            # a thread that writes zeros stops before anything writes the spare buffer's
            # rows; one that maps pages in without writing them works on meanwhile, from
            # the buffer's other end (run_pass joins it at the end)
            st.first_touch.join()
            st.first_touch = None
        # room for the pass's output vectors after the units' (see PassState.spare): the
        # snapshot's rows plus one new row per unit, more than a pass usually writes
        # (PassState.records falls back to fresh memory if not); untouched rows cost none
        if small:
            st.spare = torch.empty((st.n + len(size), st.vec.shape[1]), dtype=st.vec.dtype)
        assert st.spare is not None
        out = torch.index_select(st.vec, 0, idx, out=st.spare[: len(size)])
    else:
        out = st.vec.index_select(0, idx)
    multi = np.flatnonzero(size > 1)
    if len(multi):
        keep = np.repeat(size > 1, size)
        mseg = np.repeat(np.arange(len(multi)), size[multi])
        out[torch.from_numpy(multi).to(dev)] = segment_centroids(
            st.vec, rows[keep], mseg, len(multi), strength[rows][keep]
        )
    return out


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``int64``: the concatenation of ``arange(s, s + k)`` for each start ``s`` and size
    ``k`` (vectorised)."""
    total = int(sizes.sum())
    if not total:
        return np.zeros(0, np.int64)
    offs = np.repeat(starts - np.r_[0, np.cumsum(sizes)[:-1]], sizes)
    return np.arange(total, dtype=np.int64) + offs


def _split_apart(
    st: PassState, rows: np.ndarray, start: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Split every exact group that holds a row with ``keep_apart`` so that no subgroup holds
    two rows an undo marked apart (first fit, in id order: deterministic). Only groups of
    two or more rows with such a row are visited."""
    if not len(rows):
        return rows, start
    has_apart = st.nonempty("keep_apart")[rows]  # read in row order
    bounds = np.r_[start, len(rows)]
    size = np.diff(bounds)
    flagged = np.add.reduceat(has_apart.astype(np.int64), start) > 0
    todo = np.flatnonzero(flagged & (size > 1))
    if not len(todo):
        return rows, start
    ids = st.meta["id"].to_numpy(object)
    apart = st.meta["keep_apart"].to_numpy(object)
    new_rows = rows.copy()
    cuts: list[int] = []
    for g in todo.tolist():
        a, b = int(bounds[g]), int(bounds[g + 1])
        groups: list[list[int]] = []
        for r in rows[a:b].tolist():
            for grp in groups:
                if not any(ids[x] in apart[r] or ids[r] in apart[x] for x in grp):
                    grp.append(r)
                    break
            else:
                groups.append([r])
        flat = [r for grp in groups for r in grp]
        new_rows[a:b] = flat
        pos = a
        for grp in groups[:-1]:
            pos += len(grp)
            cuts.append(pos)
    return new_rows, np.unique(np.r_[start, np.array(cuts, np.int64)])
