"""MinHash signatures and LSH banding: a vectorised near-exact candidate stage for long texts.

Two texts are compared by the Jaccard resemblance of their sets of word k-gram shingles,
``|A & B| / |A | B|``, estimated by MinHash (A. Broder, "On the resemblance and containment
of documents", Compression and Complexity of Sequences 1997): under a random hash function
``f`` the probability that ``min f(A) == min f(B)`` equals the resemblance, so the share of
equal slots among ``num_perm`` independent minima is an unbiased estimate with binomial
standard error ``sqrt(J (1 - J) / num_perm)``. Candidate pairs come from LSH banding (J.
Leskovec, A. Rajaraman, J. D. Ullman, "Mining of Massive Datasets", ch. 3.4): the signature is
cut into ``b`` bands of ``r`` slots and two texts are candidates when all ``r`` slots of at
least one band agree, which happens with probability ``1 - (1 - J**r)**b`` (the S-curve).

Pipeline (every step is array code; no Python loop grows with the number of texts or
shingles, except :func:`consolidate.text.normalise` on the texts that need it, see 1.):

1. Words. A text's words are ``normalise(text).split()``, from
   :func:`consolidate.text.normalise_arrow` (Arrow compute for ASCII texts, one
   :func:`~consolidate.text.normalise` call per other text), split with
   ``pyarrow.compute.ascii_split_whitespace`` (after normalisation the only whitespace left
   is the ASCII space).
2. Word hashes. Distinct words (Arrow ``dictionary_encode``) are hashed with
   :func:`pandas.util.hash_array` (SipHash-2-4 of the UTF-8 bytes under pandas' fixed key,
   then a 64-bit mixer),
   which is the same in every run and process, unlike Python's ``hash``.
3. Shingles. The hash of the words ``w_0 .. w_(k-1)`` is ``s_0 = h(w_0)``,
   ``s_m = fmix64(s_(m-1) * K + h(w_m))`` (``K`` the 64-bit golden ratio, ``fmix64`` the
   MurmurHash3 finaliser, all arithmetic mod 2**64); it depends on word order. It is computed
   for every word position at once and kept only where the k words lie in one text. A text
   with ``1 <= m < k`` words has one shingle, the hash of its m words; an empty text has none.
4. Hash family. Hash function ``p`` is ``f_p(x) = fmix64(x ^ c_p)``, with ``c_p`` the
   SplitMix64 stream of ``seed`` (``fmix64`` is a bijection of uint64 with full avalanche, so
   each ``f_p`` is a keyed pseudo-random permutation of the shingle hashes). Slot ``p`` of a
   signature is ``min f_p`` over the text's shingles (``np.minimum.reduceat`` over blocks of
   at most :data:`BLOCK_BYTES` of uint64 temporaries; a text longer than a block is folded
   over blocks with a running minimum).
5. Banding. Band ``i``'s ``r`` slots are folded into one uint64 bucket key the same way as
   shingles. Rows are grouped by equal ``(segment, bucket key)`` with one stable ``lexsort``
   per band, every pair inside a group is generated with CSR/repeat arithmetic, pairs are
   de-duplicated across bands on the key ``i * n + j``, and each candidate's estimate (share
   of equal slots over all ``num_perm`` slots, float64) is compared with the threshold.

Bucket limit: a group of ``g`` equal band keys in one segment yields ``g (g - 1) / 2`` pairs,
so identical (or all-equal-in-a-band) texts make the work quadratic. Collapse exact
duplicates first (``text_hash``); a group larger than ``max_bucket`` raises ``ValueError``
naming the segment code, band and group size (``max_bucket=None`` lifts the limit).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..text import normalise_arrow

__all__ = [
    "shingle_hashes",
    "minhash_signatures",
    "minhash_pairs",
    "signature_pairs",
    "choose_bands",
    "EMPTY_SLOT",
    "BLOCK_BYTES",
    "MAX_BUCKET",
]

#: the value of every slot of the signature of a text without shingles (2**64 - 1)
EMPTY_SLOT = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
#: bytes of temporaries that one block of signature (or candidate estimate) work may use
BLOCK_BYTES = 16 << 20
#: default ``max_bucket``: largest group of equal band keys in one segment (1999000 pairs)
MAX_BUCKET = 2000
#: texts converted to Arrow and shingled at a time by :func:`minhash_signatures`
_TEXT_CHUNK = 4096

_U64 = np.uint64
_GOLDEN = _U64(0x9E37_79B9_7F4A_7C15)
_M1 = _U64(0xFF51_AFD7_ED55_8CCD)  # MurmurHash3 fmix64
_M2 = _U64(0xC4CE_B9FE_1A85_EC53)
_S1 = _U64(0xBF58_476D_1CE4_E5B9)  # SplitMix64
_S2 = _U64(0x94D0_49BB_1331_11EB)
_BAND_SALT = 0x6A09_E667_F3BC_C908  # bucket keys do not depend on ``seed``


# ----------------------------------------------------------------------------- hashing
def _fmix64(x: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser applied to ``x`` (uint64) in place; returns ``x``.

    ``tmp``: optional scratch of ``x``'s shape (uint64), to avoid allocating one."""
    if tmp is None:
        tmp = np.empty_like(x)
    np.right_shift(x, _U64(33), out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, _M1, out=x)
    np.right_shift(x, _U64(33), out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, _M2, out=x)
    np.right_shift(x, _U64(33), out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    return x


def _splitmix64(start: int, count: int) -> np.ndarray:
    """``count`` outputs (uint64) of SplitMix64 seeded with ``start`` (any int, taken mod
    2**64)."""
    z = np.arange(1, count + 1, dtype=_U64) * _GOLDEN + _U64(start % 2**64)
    z ^= z >> _U64(30)
    z *= _S1
    z ^= z >> _U64(27)
    z *= _S2
    z ^= z >> _U64(31)
    return z


def _perm_seeds(num_perm: int, seed: int) -> np.ndarray:
    """``c_p`` (uint64 [num_perm]): the keys of the hash family ``f_p(x) = fmix64(x ^ c_p)``."""
    return _splitmix64(seed, num_perm)


def _fold(acc: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``fmix64(acc * K + values)`` (uint64, new array): one step of the ordered hash
    combination used for shingles and band keys."""
    out = acc * _GOLDEN
    out += values
    return _fmix64(out)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64: the concatenation of ``arange(s, s + l)`` for each ``(s, l)`` (lengths >= 0)."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    shift = np.asarray(starts, np.int64) - (ends - lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(shift, lengths)


# ----------------------------------------------------------------------------- input checks
def _first_non_str(texts: Sequence[str], base: int) -> TypeError:
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            return TypeError(f"texts[{base + i}] is {type(t).__name__}, not str")
    return TypeError("texts must be a sequence of str")


def _to_arrow(texts: Sequence[str], base: int = 0) -> pa.Array:
    """``texts`` as one Arrow string (or large_string) array.

    Raises:
        TypeError: an entry is not a ``str`` (the message names its position, counted from
            ``base``).
        UnicodeEncodeError: an entry holds lone surrogates (not valid UTF-8); the reason
            names its position.
    """
    try:
        arr = pa.array(texts)
    except UnicodeEncodeError:
        for i, t in enumerate(texts):
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as bad:
                raise UnicodeEncodeError(
                    bad.encoding,
                    bad.object,
                    bad.start,
                    bad.end,
                    f"texts[{base + i}] holds a lone surrogate (not valid UTF-8)",
                ) from None
        raise
    except (pa.ArrowException, TypeError, ValueError):
        raise _first_non_str(texts, base) from None
    if isinstance(arr, pa.ChunkedArray):  # over 2 GiB of text: one large_string array
        arr = arr.cast(pa.large_string()).combine_chunks()
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)) or arr.null_count:
        raise _first_non_str(texts, base)
    return arr


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return int(seed)


# ----------------------------------------------------------------------------- shingles
def _word_lists(arr: pa.Array) -> pa.Array:
    """Arrow list<string> [n]: each text's words, ``normalise(text).split()``, possibly with
    empty strings at the ends (dropped by the caller). After normalisation the only
    whitespace left is the ASCII space, so an ASCII split is ``str.split``."""
    return pc.ascii_split_whitespace(normalise_arrow(arr))


def _chunk_shingles(texts: Sequence[str], k: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`shingle_hashes` of one chunk (``base``: position of its first text)."""
    n = len(texts)
    if n == 0:
        return np.zeros(0, _U64), np.zeros(1, np.int64)
    lists = _word_lists(_to_arrow(texts, base))
    words = lists.flatten()
    parent = pc.list_parent_indices(lists)
    keep = pc.greater(pc.binary_length(words), 0)
    words = words.filter(keep)
    counts = np.bincount(parent.filter(keep).to_numpy(), minlength=n).astype(np.int64)

    enc = pc.dictionary_encode(words)
    vocab = enc.dictionary.to_numpy(zero_copy_only=False).astype(object, copy=False)
    wh = pd.util.hash_array(vocab, categorize=False)[enc.indices.to_numpy()]
    wh = np.ascontiguousarray(wh, dtype=_U64)

    starts = np.cumsum(counts) - counts  # word offset of each text
    nsh = np.where(counts >= k, counts - k + 1, (counts > 0).astype(np.int64))
    g = wh  # g[p]: hash of words p .. p+m (valid where they lie in one text)
    short_rows, short_vals = [], []
    for m in range(1, k):
        done = np.flatnonzero(counts == m)  # texts of m < k words: their hash is final now
        if done.size:
            short_rows.append(starts[done])
            short_vals.append(g[starts[done]])
        if len(g) > m:
            g = np.concatenate([_fold(g[: len(g) - m], wh[m:]), g[len(g) - m :]])
    for rows, vals in zip(short_rows, short_vals, strict=True):
        g[rows] = vals
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(nsh, out=offsets[1:])
    return g[_ranges(starts, nsh)], offsets


def shingle_hashes(texts: Sequence[str], k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of the word k-gram shingles of each text, as CSR arrays.

    A text's words are ``consolidate.text.normalise(text).split()`` (NFKC, case-folded,
    whitespace-separated, sentence punctuation stripped from the ends of the text). Shingle
    ``q`` of a text with ``m >= k`` words is the ordered hash of words ``q .. q+k-1``
    (``m - k + 1`` shingles, repeats kept); a text of ``1 <= m < k`` words has one shingle
    (all its words); an empty text has none. Hashes are deterministic across runs, processes
    and machines (see the module docstring for the hash).

    Args:
        texts: ``n`` ``str``.
        k: words per shingle, ``>= 1``.

    Returns:
        ``(hashes, offsets)``: ``hashes`` uint64 ``[offsets[-1]]``, the shingles of text ``t``
        being ``hashes[offsets[t]:offsets[t + 1]]`` in text order; ``offsets`` int64
        ``[n + 1]``, starting at 0 and non-decreasing.

    Raises:
        ValueError: ``k`` is not an integer ``>= 1``.
        TypeError: an entry of ``texts`` is not a ``str`` (the message names its position).
        UnicodeEncodeError: a text holds lone surrogates (not valid UTF-8).
    """
    k = _check_int("k", k, 1)
    n = len(texts)
    parts, offs, done = [], [np.zeros(1, np.int64)], 0
    for a in range(0, n, _TEXT_CHUNK):
        h, o = _chunk_shingles(texts[a : a + _TEXT_CHUNK], k, a)
        parts.append(h)
        offs.append(o[1:] + done)
        done += len(h)
    hashes = np.concatenate(parts) if parts else np.zeros(0, _U64)
    return hashes, np.concatenate(offs)


# ----------------------------------------------------------------------------- signatures
def _signatures_into(
    out: np.ndarray, hashes: np.ndarray, offsets: np.ndarray, keys: np.ndarray
) -> None:
    """Fold the MinHash of each text's shingles into ``out`` (uint64 [n, P], pre-filled with
    :data:`EMPTY_SLOT`) by running minimum, in blocks of at most :data:`BLOCK_BYTES`."""
    num_perm = len(keys)
    counts = np.diff(offsets)
    rows = np.flatnonzero(counts > 0)  # reduceat needs strictly increasing starts
    starts = offsets[rows]
    block = max(1, BLOCK_BYTES // (2 * 8 * num_perm))
    # layout [num_perm, block]: each text's shingles are contiguous along the last axis, where
    # np.minimum.reduceat is a fast contiguous reduction (along axis 0 it is ~10x slower)
    buf = np.empty((num_perm, min(block, len(hashes))), _U64)
    tmp = np.empty_like(buf)
    for a in range(0, len(hashes), block):
        b = min(a + block, len(hashes))
        x, t = buf[:, : b - a], tmp[:, : b - a]
        np.bitwise_xor(keys[:, None], hashes[None, a:b], out=x)
        _fmix64(x, t)
        j0 = int(np.searchsorted(starts, a, "right")) - 1
        j1 = int(np.searchsorted(starts, b, "left"))
        local = starts[j0:j1] - a
        local[0] = 0  # the first text may have started in an earlier block
        mins = np.minimum.reduceat(x, local, axis=1).T
        r = rows[j0:j1]
        out[r] = np.minimum(out[r], mins)


def minhash_signatures(
    texts: Sequence[str], num_perm: int = 128, k: int = 3, seed: int = 1
) -> np.ndarray:
    """MinHash signatures of the word k-gram shingle sets of ``texts`` (Broder 1997).

    Slot ``p`` of text ``t`` is ``min over shingles x of t of fmix64(x ^ c_p)`` with ``c_p``
    the ``p``-th SplitMix64 output of ``seed``; for two texts the probability that a slot
    agrees is the Jaccard resemblance of their shingle sets (:func:`shingle_hashes`).
    Deterministic for equal ``(texts, num_perm, k, seed)``; slot ``p`` does not depend on
    ``num_perm``, so a longer signature extends a shorter one. Memory besides the output:
    the words and shingle hashes of 4096 texts at a time plus :data:`BLOCK_BYTES` of
    scratch.

    Args:
        texts: ``n`` ``str``.
        num_perm: signature length (hash functions), ``>= 1``.
        k: words per shingle, ``>= 1``.
        seed: any integer (taken mod 2**64); selects the hash family.

    Returns:
        uint64 ``[n, num_perm]`` (C order). A text without shingles (no words) has every slot
        equal to :data:`EMPTY_SLOT` (2**64 - 1).

    Raises:
        ValueError: ``num_perm`` or ``k`` is not an integer ``>= 1``, or ``seed`` is not an
            integer.
        TypeError: an entry of ``texts`` is not a ``str`` (the message names its position).
        UnicodeEncodeError: a text holds lone surrogates (not valid UTF-8).
    """
    num_perm = _check_int("num_perm", num_perm, 1)
    k = _check_int("k", k, 1)
    keys = _perm_seeds(num_perm, _check_seed(seed))
    n = len(texts)
    out = np.full((n, num_perm), EMPTY_SLOT, _U64)
    for a in range(0, n, _TEXT_CHUNK):
        h, o = _chunk_shingles(texts[a : a + _TEXT_CHUNK], k, a)
        if len(h):
            _signatures_into(out[a : a + _TEXT_CHUNK], h, o, keys)
    return out


# ----------------------------------------------------------------------------- banding
def _integrate(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Trapezoidal integral of ``y[..., i]`` over the grid ``x`` (last axis)."""
    return ((y[..., 1:] + y[..., :-1]) * 0.5 * np.diff(x)).sum(-1)


def choose_bands(threshold: float, num_perm: int, fn_weight: float = 0.5) -> tuple[int, int]:
    """LSH banding ``(bands, rows)`` for a Jaccard threshold (Leskovec, Rajaraman, Ullman,
    "Mining of Massive Datasets", ch. 3.4).

    With ``b`` bands of ``r = num_perm // b`` slots, two texts of resemblance ``s`` become
    candidates with probability ``P(s) = 1 - (1 - s**r)**b``. The choice minimises the
    weighted false-positive plus false-negative area, ``(1 - w) integral_0^t P(s) ds +
    w integral_t^1 (1 - P(s)) ds`` with ``w = fn_weight``, over ``b = 1 .. num_perm``
    (trapezoidal rule on 2001 points per side; ties go to the smaller ``b``).

    The default ``w = 0.5`` is the unweighted sum; it centres the S-curve near ``t``, so
    pairs just above ``t`` are often missed: at ``t = 0.8``, ``num_perm = 128`` it picks
    ``(9, 14)``, which finds a pair of resemblance 0.85 / 0.9 / 0.95 with probability
    0.62 / 0.90 / 0.998. :func:`signature_pairs` verifies every candidate, so a false
    positive costs one signature comparison while a false negative is lost: ``w = 0.8``
    picks ``(12, 10)`` (0.93 / 0.994 / 0.99998), at the cost of more candidates below
    ``t`` (each verified and dropped).

    Args:
        threshold: Jaccard threshold ``t``, in ``(0, 1]``.
        num_perm: signature length, ``>= 1``.
        fn_weight: weight ``w`` of the false-negative area, in ``[0, 1]``.

    Returns:
        ``(bands, rows)`` with ``bands * rows <= num_perm``.

    Raises:
        ValueError: ``threshold`` outside ``(0, 1]``, ``num_perm`` not an integer ``>= 1``
            or ``fn_weight`` outside ``[0, 1]``.
    """
    threshold = _check_threshold(threshold)
    num_perm = _check_int("num_perm", num_perm, 1)
    w = _check_weight(fn_weight)
    b = np.arange(1, num_perm + 1, dtype=np.float64)[:, None]
    r = np.floor(num_perm / b)
    lo = np.linspace(0.0, threshold, 2001)
    hi = np.linspace(threshold, 1.0, 2001)
    fp = _integrate(1.0 - (1.0 - lo**r) ** b, lo)
    fn = _integrate((1.0 - hi**r) ** b, hi)
    best = int(np.argmin((1.0 - w) * fp + w * fn))
    return best + 1, num_perm // (best + 1)


def _check_threshold(threshold) -> float:
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"threshold must be a number in (0, 1], got {threshold!r}") from None
    if not 0.0 < t <= 1.0:  # also rejects NaN
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    return t


def _check_weight(fn_weight) -> float:
    try:
        w = float(fn_weight)
    except (TypeError, ValueError):
        raise ValueError(f"fn_weight must be a number in [0, 1], got {fn_weight!r}") from None
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"fn_weight must be in [0, 1], got {fn_weight!r}")
    return w


def _check_bands(bands, num_perm: int) -> int:
    if (
        isinstance(bands, bool)
        or not isinstance(bands, (int, np.integer))
        or not 1 <= bands <= num_perm
    ):
        raise ValueError(f"bands must be an integer in [1, num_perm={num_perm}], got {bands!r}")
    return int(bands)


def _check_segments(segments, n: int) -> np.ndarray:
    seg = np.asarray(segments)
    if seg.ndim != 1 or len(seg) != n:
        raise ValueError(
            f"segments must have shape ({n},) (one code per text), got shape {seg.shape}"
        )
    if not np.issubdtype(seg.dtype, np.integer):
        raise ValueError(f"segments must be integer codes, got dtype {seg.dtype}")
    return seg


def _band_keys(sig: np.ndarray, live: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 [len(live), bands]: band ``i``'s ``rows`` slots (columns ``i * rows ..
    (i + 1) * rows - 1``) of the rows ``live`` folded into one bucket key."""
    acc = np.broadcast_to(_splitmix64(_BAND_SALT, bands), (len(live), bands))
    first = np.arange(bands) * rows
    for c in range(rows):
        acc = _fold(acc, sig[live[:, None], first[None, :] + c])
    return acc


def _group_pairs(
    order: np.ndarray,
    new_group: np.ndarray,
    seg_sorted: np.ndarray,
    band: int,
    max_bucket: int | None,
    skipped: dict[str, int] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """All pairs ``(order[x], order[y])``, ``x < y``, of sorted positions in one group.

    ``new_group``: bool [m], True where a group starts in the sorted order. Groups larger
    than ``max_bucket`` raise, or with ``skipped`` (a dict) are left out and counted in it
    (``buckets``, ``rows``)."""
    gstart = np.flatnonzero(new_group)
    sizes = np.diff(np.append(gstart, len(order)))
    big = sizes >= 2
    gstart, sizes = gstart[big], sizes[big]
    if skipped is not None and max_bucket is not None:
        over = sizes > max_bucket
        skipped["buckets"] = skipped.get("buckets", 0) + int(over.sum())
        skipped["rows"] = skipped.get("rows", 0) + int(sizes[over].sum())
        gstart, sizes = gstart[~over], sizes[~over]
    if max_bucket is not None and len(sizes) and sizes.max() > max_bucket:
        g = int(np.argmax(sizes))
        raise ValueError(
            f"segment {int(seg_sorted[gstart[g]])}: {int(sizes[g])} texts share band {band}'s "
            f"bucket (max_bucket={max_bucket}); they would give "
            f"{int(sizes[g]) * (int(sizes[g]) - 1) // 2} candidate pairs. Collapse exact "
            "duplicates first or raise max_bucket (None: no limit)"
        )
    members = _ranges(gstart, sizes)  # sorted positions inside groups of >= 2
    local = members - np.repeat(gstart, sizes)
    later = np.repeat(sizes, sizes) - 1 - local  # partners after each member
    left = np.repeat(members, later)
    right = left + 1 + _ranges(np.zeros(len(later), np.int64), later)
    return order[left], order[right]


def signature_pairs(
    signatures: np.ndarray,
    segments: np.ndarray,
    *,
    threshold: float = 0.8,
    bands: int | None = None,
    fn_weight: float = 0.5,
    max_bucket: int | None = MAX_BUCKET,
    skipped: dict[str, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Near-exact pairs from MinHash signatures by LSH banding (Leskovec, Rajaraman, Ullman,
    "Mining of Massive Datasets", ch. 3.4), within segments.

    Rows ``i < j`` of one segment are candidates when all ``r`` slots of at least one of
    ``b`` bands agree; a candidate is kept when its estimated Jaccard, the share of equal
    slots over all ``num_perm`` slots (float64), is ``>= threshold``. Candidates are exact
    with respect to the banding (no sampling); a pair of true resemblance ``s`` is found with
    probability ``1 - (1 - s**r)**b``. Rows whose slots are all :data:`EMPTY_SLOT` (texts
    without shingles) take part in no pair.

    Args:
        signatures: uint64 ``[n, num_perm]`` from :func:`minhash_signatures`.
        segments: integer codes ``[n]`` (e.g. namespace codes); pairs never cross codes.
        threshold: Jaccard threshold in ``(0, 1]``.
        bands: number of bands ``b`` in ``[1, num_perm]``, each of ``r = num_perm // b``
            slots (the last ``num_perm - b * r`` slots count only in the estimate); ``None``
            picks ``choose_bands(threshold, num_perm, fn_weight)``.
        fn_weight: see :func:`choose_bands` (used only when ``bands`` is ``None``).
        max_bucket: the largest group of rows of one segment sharing one band's bucket;
            ``None`` for no limit. A group of ``g`` rows yields ``g (g - 1) / 2`` pairs.
        skipped: ``None`` (a larger group raises) or a dict: larger groups are left out of
            that band's candidates and counted in it (``skipped["buckets"]``,
            ``skipped["rows"]``, summed over bands).

    Returns:
        ``(i, j, jaccard)``: int64, int64, float64 ``[m]``; ``i < j`` row positions, each pair
        once, sorted by ``(i, j)``; ``jaccard >= threshold`` (a multiple of ``1 / num_perm``).

    Raises:
        ValueError: bad shapes or dtypes, ``threshold`` outside ``(0, 1]``, ``bands`` outside
            ``[1, num_perm]``, ``fn_weight`` outside ``[0, 1]``, ``max_bucket`` not ``None``
            or an integer ``>= 2``, or (``skipped`` is ``None``) a group larger than
            ``max_bucket`` (the message names the segment code and band).
    """
    sig = np.asarray(signatures)
    if sig.ndim != 2 or sig.dtype != _U64 or sig.shape[1] < 1:
        raise ValueError(
            "signatures must be a uint64 array [n, num_perm] with num_perm >= 1, "
            f"got dtype {sig.dtype} shape {sig.shape}"
        )
    n, num_perm = sig.shape
    seg = _check_segments(segments, n)
    threshold = _check_threshold(threshold)
    if bands is None:
        bands, rows = choose_bands(threshold, num_perm, fn_weight)
    else:
        bands = _check_bands(bands, num_perm)
        rows = num_perm // bands
    if max_bucket is not None:
        max_bucket = _check_int("max_bucket", max_bucket, 2)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))

    # rows without shingles: every slot EMPTY_SLOT (test column 0 first: no [n, P] temporary)
    maybe = np.flatnonzero(sig[:, 0] == EMPTY_SLOT)
    dead = maybe[(sig[maybe] == EMPTY_SLOT).all(axis=1)] if len(maybe) else maybe
    live = np.setdiff1d(np.arange(n), dead, assume_unique=True) if len(dead) else np.arange(n)
    if len(live) < 2:
        return empty
    pair_keys = _banded_candidates(
        _band_keys(sig, live, bands, rows), seg[live], max_bucket, skipped
    )
    if not len(pair_keys):
        return empty
    a, b = np.divmod(pair_keys, len(live))
    i, j = live[a], live[b]  # live is increasing: (i, j) keep the sorted order of (a, b)
    est = _estimated_jaccard(sig, i, j)
    ok = est >= threshold
    return i[ok], j[ok], est[ok]


def _estimated_jaccard(sig: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``float64 [m]``: the share of equal slots of the signatures of rows ``i`` and ``j``
    (in blocks of about :data:`BLOCK_BYTES`)."""
    num_perm = sig.shape[1]
    matches = np.empty(len(i), np.int64)
    step = max(1, BLOCK_BYTES // (3 * 8 * num_perm))
    for s in range(0, len(i), step):
        matches[s : s + step] = (sig[i[s : s + step]] == sig[j[s : s + step]]).sum(axis=1)
    return matches / num_perm


def _banded_candidates(
    bkeys: np.ndarray,
    lseg: np.ndarray,
    max_bucket: int | None,
    skipped: dict[str, int] | None,
) -> np.ndarray:
    """``int64``: the candidate pairs ``a < b`` of rows (positions into ``bkeys``' ``m``
    rows) that share a segment and one band's key, as sorted unique keys ``a * m + b``.

    Args:
        bkeys: ``[m, bands]`` band keys (:func:`_band_keys`).
        lseg: ``[m]`` segment codes.
        max_bucket, skipped: see :func:`signature_pairs`.
    """
    m, bands = bkeys.shape
    pair_keys = np.zeros(0, np.int64)
    for band in range(bands):
        key = bkeys[:, band]
        order = np.lexsort((key, lseg))  # stable: rows ascending inside a group
        ks, ss = key[order], lseg[order]
        new_group = np.empty(m, bool)
        new_group[0] = True
        np.not_equal(ks[1:], ks[:-1], out=new_group[1:])
        new_group[1:] |= ss[1:] != ss[:-1]
        if new_group.all():
            continue
        a, b = _group_pairs(order, new_group, ss, band, max_bucket, skipped)
        pair_keys = np.union1d(pair_keys, a * m + b)  # a < b: order is ascending in groups
    return pair_keys


def minhash_pairs(
    texts: Sequence[str],
    segments: np.ndarray,
    *,
    threshold: float = 0.8,
    num_perm: int = 128,
    k: int = 3,
    bands: int | None = None,
    seed: int = 1,
    fn_weight: float = 0.5,
    max_bucket: int | None = MAX_BUCKET,
    skipped: dict[str, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate near-exact pairs of texts within segments: :func:`minhash_signatures`
    (Broder 1997) then :func:`signature_pairs` (LSH banding, Leskovec, Rajaraman, Ullman,
    "Mining of Massive Datasets", ch. 3.4).

    Args:
        texts: ``n`` ``str``.
        segments: integer codes ``[n]`` (e.g. namespace codes); pairs never cross codes.
        threshold: Jaccard threshold on word k-gram shingle sets, in ``(0, 1]``.
        num_perm: signature length, ``>= 1``; the estimate's standard error is
            ``sqrt(J (1 - J) / num_perm)`` (0.035 at ``J = 0.8``, ``num_perm = 128``).
        k: words per shingle, ``>= 1``.
        bands: LSH bands (``None``: :func:`choose_bands`), see :func:`signature_pairs`.
        seed: any integer; selects the hash family.
        fn_weight: weight of false negatives in the band choice (used only when ``bands``
            is ``None``): see :func:`choose_bands`.
        max_bucket: largest group of texts of one segment sharing one band's bucket, or
            ``None``; see :func:`signature_pairs`.
        skipped: ``None`` (a larger bucket raises) or a dict in which larger buckets are
            counted instead of searched; see :func:`signature_pairs`.

    Returns:
        ``(i, j, jaccard)``: int64 ``i < j`` positions into ``texts``, float64 estimated
        Jaccard ``>= threshold``; each pair once, sorted by ``(i, j)``. Texts without words
        take part in no pair.

    Raises:
        ValueError: a bad argument (``segments`` length or dtype, ``threshold``,
            ``num_perm``, ``k``, ``bands``, ``seed``, ``fn_weight``, ``max_bucket``) or,
            without ``skipped``, a bucket larger than ``max_bucket`` (the message names the
            segment code).
        TypeError: an entry of ``texts`` is not a ``str`` (the message names its position).
        UnicodeEncodeError: a text holds lone surrogates (not valid UTF-8).
    """
    # check the cheap arguments before hashing
    _check_segments(segments, len(texts))
    _check_threshold(threshold)
    num_perm = _check_int("num_perm", num_perm, 1)
    if bands is not None:
        _check_bands(bands, num_perm)
    _check_weight(fn_weight)
    if max_bucket is not None:
        _check_int("max_bucket", max_bucket, 2)
    sig = minhash_signatures(texts, num_perm=num_perm, k=k, seed=seed)
    return signature_pairs(
        sig,
        segments,
        threshold=threshold,
        bands=bands,
        fn_weight=fn_weight,
        max_bucket=max_bucket,
        skipped=skipped,
    )
