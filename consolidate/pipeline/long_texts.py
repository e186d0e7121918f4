"""Stage 3b, near-exact long texts: MinHash candidates for units with long texts.

Sentence embeddings summarise a long text in one vector (all-MiniLM-L6-v2 reads only its
first 256 word pieces), so two long memories that say nearly the same thing word for word
can score below the cosine threshold. This stage proposes such pairs from the texts
themselves: units whose text has at least ``cfg.minhash_min_chars`` characters get MinHash
signatures of their word 3-grams (:func:`consolidate.ops.minhash.minhash_pairs`), and pairs in
one namespace whose estimated Jaccard reaches ``cfg.minhash_threshold`` are candidates.

It only proposes. A candidate joins the pass's pairs (``st.pairs``) with its float64 cosine,
and the cluster stage still decides: the conflict guard applies as to every pair, and the
centroid condition must hold. A candidate at or above the cosine threshold is an ordinary
pair (the similarity join has it already unless ``near_dedup`` is off). One below it is
admitted only as an isolated pair (neither unit in any other pair) whose two units both
reach the threshold against their strength-weighted centroid, so the clustering's
guarantee (every final cluster passes the centroid check) still holds; the other candidates
are counted in ``stats.minhash_pairs`` and left apart.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from ..config import PassConfig
from ..ops.minhash import minhash_pairs
from ..similarity import Pairs
from .state import PassState, list_lengths

__all__ = ["long_text_stage", "MINHASH_PERM", "MINHASH_FN_WEIGHT", "MINHASH_MAX_BUCKET"]

#: signature slots (standard error of the Jaccard estimate about 0.035 at J = 0.8)
MINHASH_PERM = 128
#: LSH band choice weighs a missed pair 0.8 against 0.2 for a spurious candidate (every
#: candidate is then checked against its full-signature estimate)
MINHASH_FN_WEIGHT = 0.8
#: a band bucket shared by more long texts of one namespace than this (templated texts:
#: the same boilerplate) is not searched for that band (its pairs would grow
#: quadratically); counted in ``stats.minhash_skipped_buckets``, the pass goes on
MINHASH_MAX_BUCKET = 256


def long_text_stage(st: PassState, cfg: PassConfig) -> PassState:
    """Add the admitted MinHash candidates of long-text units to ``st.pairs`` (see the
    module docstring); sets ``stats.minhash_units`` (units long enough),
    ``stats.minhash_pairs`` (candidates) and ``stats.minhash_added`` (pairs added that the
    similarity join did not have) and ``stats.minhash_skipped_buckets`` (band buckets
    larger than :data:`MINHASH_MAX_BUCKET`, left unsearched). Nothing happens when
    ``cfg.minhash_min_chars`` is ``None``."""
    if cfg.minhash_min_chars is None:
        return st
    stats = st.stats
    stats.minhash_units = stats.minhash_pairs = stats.minhash_added = 0
    stats.minhash_skipped_buckets = 0
    u = st.units
    if u is None or len(u) < 2:
        return st
    col = st.meta["text"].to_numpy(object)
    # lengths in code points (Python's len, Arrow's utf8_length), read in row order; only
    # the long texts are converted to Arrow
    long_ = np.flatnonzero(list_lengths(col)[u.first] >= cfg.minhash_min_chars)
    stats.minhash_units = len(long_)
    if len(long_) < 2:
        return st
    skipped: dict[str, int] = {}
    i, j, _ = minhash_pairs(
        pa.array(col[u.first[long_]], pa.string()),
        u.ns[long_],
        threshold=cfg.minhash_threshold,
        num_perm=MINHASH_PERM,
        fn_weight=MINHASH_FN_WEIGHT,
        max_bucket=MINHASH_MAX_BUCKET,
        skipped=skipped,
    )
    stats.minhash_pairs = len(i)
    stats.minhash_skipped_buckets = skipped.get("buckets", 0)
    if not len(i):
        return st
    ci, cj = long_[i], long_[j]  # unit positions, ci < cj (long_ is sorted)
    n_units = len(u)
    old = (
        st.pairs
        if st.pairs is not None
        else Pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    )
    old_key = old.i * n_units + old.j
    new = ~np.isin(ci * n_units + cj, old_key)
    ci, cj = ci[new], cj[new]
    if not len(ci):
        return st
    dev = u.vec.device
    a = u.vec.index_select(0, torch.from_numpy(ci).to(dev)).double()
    b = u.vec.index_select(0, torch.from_numpy(cj).to(dev)).double()
    cos = (a * b).sum(1)
    above = (cos >= cfg.threshold).cpu().numpy()
    # below the threshold: an isolated pair whose weighted centroid both units reach
    w = torch.from_numpy(u.weight).to(dev)
    c = w[torch.from_numpy(ci).to(dev), None] * a + w[torch.from_numpy(cj).to(dev), None] * b
    c = c / c.norm(dim=1, keepdim=True)
    centroid_ok = (torch.minimum((a * c).sum(1), (b * c).sum(1)) >= cfg.threshold).cpu().numpy()
    degree = np.bincount(np.concatenate([old.i, old.j, ci, cj]), minlength=n_units)
    isolated = (degree[ci] == 1) & (degree[cj] == 1)
    keep = above | (isolated & centroid_ok)
    if not keep.any():
        return st
    ai, aj, asim = ci[keep], cj[keep], cos.cpu().numpy()[keep]
    i_all = np.concatenate([old.i, ai])
    j_all = np.concatenate([old.j, aj])
    order = np.lexsort((j_all, i_all))
    st.pairs = Pairs(i_all[order], j_all[order], np.concatenate([old.sim, asim])[order])
    stats.minhash_added = int(keep.sum())
    return st
