"""MinHash shingles, signatures and LSH pairs against plain-Python references."""

import math

import numpy as np
import pandas as pd
import pytest

from consolidate.ops import minhash as mh
from consolidate.ops.minhash import (
    EMPTY_SLOT,
    choose_bands,
    minhash_pairs,
    minhash_signatures,
    shingle_hashes,
    signature_pairs,
)
from consolidate.text import normalise

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


# ----------------------------------------------------------------------------- references
def fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def perm_keys(num_perm: int, seed: int) -> list[int]:
    """SplitMix64, sequentially."""
    out, state = [], seed % 2**64
    for _ in range(num_perm):
        state = (state + GOLDEN) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append(z ^ (z >> 31))
    return out


def ref_shingles(texts: list[str], k: int) -> list[list[int]]:
    """Shingle hashes per text, one word and one k-gram at a time."""
    words = [normalise(t).split() for t in texts]
    vocab = sorted({w for ws in words for w in ws})
    wh = dict(
        zip(
            vocab,
            map(int, pd.util.hash_array(np.array(vocab, object), categorize=False)),
            strict=True,
        )
    )

    def combine(ws):
        s = wh[ws[0]]
        for w in ws[1:]:
            s = fmix64((s * GOLDEN + wh[w]) & M64)
        return s

    out = []
    for ws in words:
        if not ws:
            out.append([])
        elif len(ws) < k:
            out.append([combine(ws)])
        else:
            out.append([combine(ws[q : q + k]) for q in range(len(ws) - k + 1)])
    return out


def ref_signature(shingles: list[int], keys: list[int]) -> list[int]:
    if not shingles:
        return [M64] * len(keys)
    return [min(fmix64(x ^ c) for x in shingles) for c in keys]


def csr(texts, k=3):
    h, off = shingle_hashes(texts, k=k)
    return [h[off[t] : off[t + 1]].tolist() for t in range(len(texts))]


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b)


def random_words(rng, n):
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = {"".join(rng.choice(letters, rng.integers(3, 9))) for _ in range(n)}
    return np.array(sorted(words))


def edit(rng, vocab, words, changes):
    """``words`` with ``changes`` distinct positions replaced by other vocabulary words."""
    out = list(words)
    for p in rng.choice(len(out), changes, replace=False):
        out[p] = str(rng.choice(vocab[vocab != out[p]]))
    return out


# ----------------------------------------------------------------------------- shingles
def test_shingle_counts():
    texts = ["one two three four five", "One two.", "", "   ", "single", "a b c", "..."]
    for k, want in [
        (3, [3, 1, 0, 0, 1, 1, 1]),
        (1, [5, 2, 0, 0, 1, 3, 1]),
        (5, [1, 1, 0, 0, 1, 1, 1]),
        (6, [1, 1, 0, 0, 1, 1, 1]),
    ]:
        h, off = shingle_hashes(texts, k=k)
        assert h.dtype == np.uint64 and off.dtype == np.int64
        assert np.diff(off).tolist() == want
        assert off[0] == 0 and off[-1] == len(h)
    h, off = shingle_hashes([])
    assert h.shape == (0,) and off.tolist() == [0]


def test_shingle_hashes_equal_reference():
    rng = np.random.default_rng(3)
    pieces = [
        "Alpha",
        "beta,",
        "GAMMA",
        "delta.",
        "'quoted'",
        "\u201ccurly\u201d",
        "Stra\u00dfe",
        "caf\u00e9",
        "\u0130stanbul",
        "x\u00a0y",
        "a\x1cb",
        "-5",
        "don't",
        "!?",
        "\t",
        "\n",
        "\x0b",
        "\x0c",
        "`tick`",
        '"',
        "x.y;",
        "\x7f",
        ",",
        "\r\n",
        "\u00c9milie",
        "\u00dcber",
        "\u03a3\u0391\u03a3",
        "\u03c2",
        "\U0001f600",
        "\u2014",
        "\u2026",
        "e\u0301",
        "\u1100\u1161",
        "\ufb01",
        "\u2018x\u2019",
        "\u13f8",
        "\u212a",
    ]
    texts = [" ".join(rng.choice(pieces, rng.integers(0, 12))) for _ in range(300)]
    texts += ["", "   ", "...", "'", "Hello, World!", "\u00a0\u00a0"]
    for k in (1, 2, 3, 5):
        assert csr(texts, k) == ref_shingles(texts, k)


def test_shingle_normalisation_and_order():
    a, b, c = csr(["Hello   big World.", "hello big world", "world big hello"])
    assert a == b and a != c
    assert csr(["STRASSE caf\u00e9 now"]) == csr(["stra\u00dfe CAF\u00c9 NOW!"])
    x, y = csr(["a b c d e", "b a c d e"])
    assert x[2] == y[2] and x[0] != y[0] and x[1] != y[1]  # "c d e" is the only common 3-gram
    short_ab, short_ba = csr(["a b", "b a"])
    assert short_ab != short_ba


def test_hashes_are_fixed_values():
    """Pinned values: the hashes must not depend on the process, platform or hash seed."""
    assert csr(["The quick brown fox jumps."])[0] == [
        9996454633219028676,
        2635161802834253518,
        9928858911584231634,
    ]
    assert minhash_signatures(["The quick brown fox jumps."], num_perm=4)[0].tolist() == [
        3064337600382973604,
        3830025690697545415,
        548304922368100481,
        691594495304598403,
    ]


# ----------------------------------------------------------------------------- signatures
def test_signatures_equal_reference():
    rng = np.random.default_rng(5)
    vocab = random_words(rng, 200)
    texts = [" ".join(rng.choice(vocab, rng.integers(0, 40))) for _ in range(40)]
    texts[3] = ""
    for k, num_perm, seed in [(3, 16, 1), (2, 7, 123456789), (1, 3, -5)]:
        sig = minhash_signatures(texts, num_perm=num_perm, k=k, seed=seed)
        assert sig.dtype == np.uint64 and sig.shape == (len(texts), num_perm)
        keys = perm_keys(num_perm, seed)
        want = [ref_signature(s, keys) for s in ref_shingles(texts, k)]
        assert sig.tolist() == want
    assert (minhash_signatures(["", "  "], num_perm=5) == EMPTY_SLOT).all()


def test_signatures_independent_of_chunks_and_blocks(monkeypatch):
    rng = np.random.default_rng(8)
    vocab = random_words(rng, 300)
    texts = [" ".join(rng.choice(vocab, rng.integers(0, 60))) for _ in range(23)]
    texts[0] = texts[5] = texts[22] = ""
    sig, (h, off) = minhash_signatures(texts, num_perm=8), shingle_hashes(texts)
    monkeypatch.setattr(mh, "_TEXT_CHUNK", 4)
    monkeypatch.setattr(mh, "BLOCK_BYTES", 2 * 8 * 8 * 7)  # 7 shingles per block
    assert (minhash_signatures(texts, num_perm=8) == sig).all()
    h2, off2 = shingle_hashes(texts)
    assert (h2 == h).all() and (off2 == off).all()
    bad = list(texts)
    bad[9] = None
    with pytest.raises(TypeError, match=r"texts\[9\] is NoneType"):
        minhash_signatures(bad)


def test_signature_estimate_within_binomial_bound():
    """50 pairs with Jaccard spread over (0, 1]; num_perm = 256.

    With independent slots the estimate is Binomial(256, J) / 256, with standard deviation
    sd(J) = sqrt(J (1 - J) / 256) <= 1/32. Bounds: every |error| <= 4/32 (a 4-sigma bound
    for any J: chance < 50 * 6.4e-5 = 0.3% that one of 50 pairs exceeds it); the mean of
    |error| / sd(J) (expected sqrt(2 / pi) = 0.80, standard error 0.6 / sqrt(50) = 0.085) is
    below 1.2; the mean signed error is within 4 standard errors of 0 (no bias).
    """
    rng = np.random.default_rng(12)
    vocab = random_words(rng, 800)
    texts = []
    for q in range(50):
        words = list(rng.choice(vocab, 200))
        texts += [" ".join(words), " ".join(edit(rng, vocab, words, 1 + 2 * q))]
    num_perm = 256
    sig = minhash_signatures(texts, num_perm=num_perm)
    sh = csr(texts)
    true = np.array([jaccard(sh[2 * q], sh[2 * q + 1]) for q in range(50)])
    est = (sig[0::2] == sig[1::2]).mean(axis=1)
    assert true.min() < 0.1 and true.max() > 0.95  # the pairs span the range
    err = est - true
    sd = np.sqrt(true * (1 - true) / num_perm)
    assert np.abs(err).max() <= 4 / 32
    assert (np.abs(err) / sd).mean() < 1.2
    assert abs(err.mean()) <= 4 * math.sqrt((sd**2).mean() / 50)


def test_signatures_deterministic_and_prefix():
    rng = np.random.default_rng(2)
    vocab = random_words(rng, 100)
    texts = [" ".join(rng.choice(vocab, 30)) for _ in range(10)]
    a = minhash_signatures(texts, num_perm=64)
    assert (a == minhash_signatures(list(texts), num_perm=64)).all()
    assert (a == minhash_signatures(tuple(texts), num_perm=64)).all()
    assert (a == minhash_signatures(np.array(texts), num_perm=64)).all()
    assert (a[:, :16] == minhash_signatures(texts, num_perm=16)).all()
    assert (a != minhash_signatures(texts, num_perm=64, seed=2)).mean() > 0.9


# ----------------------------------------------------------------------------- pairs
def planted(seed=21):
    """Long random texts in segments 3, 11, 42; near-copies with 0..14 changed words in the
    same segment; one exact copy in another segment; empty and short texts."""
    rng = np.random.default_rng(seed)
    vocab = random_words(rng, 1500)
    codes = np.array([3, 11, 42])
    texts, seg, pairs = [], [], []
    for _ in range(40):
        texts.append(list(rng.choice(vocab, rng.integers(150, 250))))
        seg.append(int(rng.choice(codes)))
    for q, changes in enumerate([0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 8, 10, 12, 14] * 2):
        texts.append(edit(rng, vocab, texts[q], changes))
        seg.append(seg[q])
        pairs.append((q, len(texts) - 1))
    texts.append(list(texts[0]))  # exact copy of text 0 in another segment
    seg.append(int(codes[codes != seg[0]][0]))
    texts += [[], [], ["tiny"], ["tiny"]]
    seg += [3, 3, 11, 11]
    return [" ".join(w) for w in texts], np.array(seg, np.int64), pairs


def brute_force(sig, seg, threshold, bands, rows):
    """{(i, j): estimate} of every same-segment pair with one fully equal band and
    estimate >= threshold (texts without shingles excluded)."""
    out = {}
    live = [t for t in range(len(sig)) if not (sig[t] == EMPTY_SLOT).all()]
    for x, i in enumerate(live):
        for j in live[x + 1 :]:
            if seg[i] != seg[j]:
                continue
            eq = sig[i] == sig[j]
            if any(eq[b * rows : (b + 1) * rows].all() for b in range(bands)):
                est = eq.mean()
                if est >= threshold:
                    out[(i, j)] = est
    return out


@pytest.mark.parametrize("num_perm,bands", [(128, None), (128, 7), (64, 1), (32, 32)])
def test_pairs_equal_banding_reference(num_perm, bands):
    texts, seg, _ = planted()
    i, j, est = minhash_pairs(texts, seg, threshold=0.8, num_perm=num_perm, bands=bands)
    sig = minhash_signatures(texts, num_perm=num_perm)
    b = bands or choose_bands(0.8, num_perm)[0]
    want = brute_force(sig, seg, 0.8, b, num_perm // b)
    assert i.dtype == np.int64 and j.dtype == np.int64 and est.dtype == np.float64
    assert dict(zip(zip(i.tolist(), j.tolist(), strict=True), est.tolist(), strict=True)) == want
    keys = i * len(texts) + j
    assert (np.diff(keys) > 0).all()  # sorted by (i, j), each pair once
    assert (i < j).all() and (seg[i] == seg[j]).all() and (est >= 0.8).all()
    assert len(want) >= (5 if b == 1 else 10)  # bands=1: identical signatures only


def test_pairs_find_planted_near_copies():
    texts, seg, pairs = planted()
    sh = csr(texts)
    true = {p: jaccard(sh[p[0]], sh[p[1]]) for p in pairs}
    assert sum(v >= 0.9 for v in true.values()) >= 15 and min(true.values()) < 0.7
    # fn_weight = 0.8 at num_perm = 256 picks (21, 12): P(find | J = 0.9) = 0.9991
    i, j, est = minhash_pairs(texts, seg, threshold=0.8, num_perm=256, fn_weight=0.8)
    got = dict(zip(zip(i.tolist(), j.tolist(), strict=True), est.tolist(), strict=True))
    for p, jac in true.items():
        if jac >= 0.9:
            assert p in got, (p, jac)
        if jac == 1.0:
            assert got[p] == 1.0
    # every returned pair is a real near-copy (unrelated texts share no 3-gram)
    for (a, b), e in got.items():
        assert jaccard(sh[a], sh[b]) >= 0.65 and e >= 0.8 and seg[a] == seg[b]
    n = len(texts)
    assert (0, n - 5) not in got  # the exact copy in another segment
    assert got[(n - 2, n - 1)] == 1.0  # two equal one-word texts
    assert not any(t in (n - 4, n - 3) for t in i.tolist() + j.tolist())  # empty texts
    assert (i < j).all() and (np.diff(i * n + j) > 0).all()


def test_identical_texts_and_bucket_limit():
    base = " ".join(f"w{q}" for q in range(50))
    texts = [base] * 5 + ["other words entirely here now", base]
    seg = np.array([7, 7, 7, 7, 7, 7, 8])
    i, j, est = minhash_pairs(texts, seg)
    assert list(zip(i.tolist(), j.tolist(), strict=True)) == [
        (a, b) for a in range(5) for b in range(a + 1, 5)
    ]
    assert (est == 1.0).all()
    with pytest.raises(ValueError, match=r"segment 7: 5 texts share band 0's bucket"):
        minhash_pairs(texts, seg, max_bucket=4)
    assert len(minhash_pairs(texts, seg, max_bucket=None)[0]) == 10
    assert len(minhash_pairs(texts, seg, max_bucket=5)[0]) == 10


def test_pairs_small_inputs():
    for texts in ([], ["only one"], ["", ""]):
        i, j, est = minhash_pairs(texts, np.zeros(len(texts), np.int32))
        assert len(i) == len(j) == len(est) == 0
        assert i.dtype == np.int64 and est.dtype == np.float64


def test_signature_pairs_matches_minhash_pairs():
    texts, seg, _ = planted(seed=4)
    sig = minhash_signatures(texts, num_perm=64, seed=9)
    a = signature_pairs(sig, seg.astype(np.int16), threshold=0.7)
    b = minhash_pairs(texts, seg, threshold=0.7, num_perm=64, seed=9)
    for x, y in zip(a, b, strict=True):
        assert (x == y).all()


# ----------------------------------------------------------------------------- bands
def test_choose_bands():
    assert choose_bands(0.8, 128) == (9, 14)
    assert choose_bands(0.5, 128) == (25, 5)
    assert choose_bands(0.8, 128, fn_weight=0.8) == (12, 10)
    assert choose_bands(0.5, 1) == (1, 1)
    for t in (0.05, 0.3, 0.7, 0.9, 1.0):
        for p in (16, 100, 256):
            b, r = choose_bands(t, p)
            assert 1 <= b <= p and r == p // b
    # a higher threshold needs more rows per band
    rows = [choose_bands(t, 128)[1] for t in (0.3, 0.5, 0.7, 0.9)]
    assert rows == sorted(rows) and rows[0] < rows[-1]


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"segments": np.zeros(2, np.int64)}, "segments must have shape"),
        ({"segments": np.zeros((3, 1), np.int64)}, "segments must have shape"),
        ({"segments": np.zeros(3)}, "integer codes"),
        ({"threshold": 0.0}, "threshold"),
        ({"threshold": 1.5}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
        ({"threshold": "high"}, "threshold"),
        ({"num_perm": 0}, "num_perm"),
        ({"num_perm": 2.0}, "num_perm"),
        ({"k": 0}, "k must be"),
        ({"bands": 0}, "bands"),
        ({"bands": 129}, "bands"),
        ({"fn_weight": 1.5}, "fn_weight"),
        ({"max_bucket": 1}, "max_bucket"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_pairs_bad_arguments(kwargs, match):
    args = {"segments": np.zeros(3, np.int64), **kwargs}
    with pytest.raises(ValueError, match=match):
        minhash_pairs(["a b c", "a b c", "d e f"], **args)


@pytest.mark.parametrize(
    "bad,pos,name",
    [
        (["ok", None, "x"], 1, "NoneType"),
        ([3, "x"], 0, "int"),
        (["x", "y", b"z"], 2, "bytes"),
        (["x", 2.5], 1, "float"),
        (np.array([b"a", b"b"]), 0, "bytes_"),
    ],
)
def test_non_str_texts_raise_type_error(bad, pos, name):
    for fn in (shingle_hashes, minhash_signatures):
        with pytest.raises(TypeError, match=rf"texts\[{pos}\] is {name}, not str"):
            fn(bad)
    with pytest.raises(TypeError, match=rf"texts\[{pos}\]"):
        minhash_pairs(bad, np.zeros(len(bad), np.int64))


def test_lone_surrogate_and_signature_checks():
    with pytest.raises(UnicodeEncodeError, match=r"texts\[1\] holds a lone surrogate"):
        shingle_hashes(["fine", "bad \ud800 text"])
    with pytest.raises(ValueError, match="uint64"):
        signature_pairs(np.zeros((3, 4), np.int64), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="shape"):
        signature_pairs(np.zeros((3, 4), np.uint64), np.zeros(4, np.int64))
