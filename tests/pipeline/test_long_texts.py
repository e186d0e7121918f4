"""The MinHash stage for long texts inside the pass: it proposes, the cluster stage decides."""

import numpy as np
import pytest

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.ops.minhash import minhash_pairs
from consolidate.pipeline import run_pass
from consolidate.pipeline.long_texts import MINHASH_FN_WEIGHT, MINHASH_PERM
from tests.helpers import make_records

WORDS = [
    "garden",
    "kitchen",
    "window",
    "river",
    "mountain",
    "pencil",
    "basket",
    "violin",
    "lantern",
    "meadow",
    "harbor",
    "orchard",
    "blanket",
    "teapot",
    "castle",
    "forest",
    "pebble",
    "canyon",
    "island",
    "bakery",
    "library",
    "market",
    "village",
    "bridge",
    "tunnel",
    "saddle",
    "compass",
    "feather",
    "marble",
    "velvet",
    "copper",
    "silver",
    "amber",
    "cedar",
    "maple",
    "willow",
    "thistle",
    "clover",
    "sparrow",
    "falcon",
    "otter",
    "badger",
    "heron",
    "salmon",
    "walnut",
    "almond",
    "ginger",
    "pepper",
    "saffron",
    "honey",
    "biscuit",
    "noodle",
    "dumpling",
    "pancake",
    "lemon",
    "cherry",
]


def _text(rng, n_words=90):
    return " ".join(rng.choice(WORDS, n_words))


def _edit(text, rng, n=1):
    """Replace ``n`` words far apart (word 3-gram Jaccard about (m - 3n) / (m + 3n))."""
    w = text.split()
    for p in np.linspace(10, len(w) - 10, n).astype(int):
        w[p] = "zebra" if w[p] != "zebra" else "yak"
    return " ".join(w)


def _pair_vectors(rng, d, cos):
    a = rng.normal(size=d)
    a /= np.linalg.norm(a)
    e = rng.normal(size=d)
    e -= (e @ a) * a
    e /= np.linalg.norm(e)
    return a, cos * a + np.sqrt(1 - cos**2) * e


def _store():
    """Pairs planted one per namespace (vectors with a chosen cosine, texts chosen to be
    near-exact or not); see the expectations in the test."""
    rng = np.random.default_rng(0)
    d = 64
    rows = []

    def add(name, text_a, text_b, cos, ns_b=None, strengths=(1.0, 1.0)):
        va, vb = _pair_vectors(rng, d, cos)
        for tag, t, v, ns, s in (
            ("a", text_a, va, name, strengths[0]),
            ("b", text_b, vb, ns_b or name, strengths[1]),
        ):
            rows.append(
                {
                    "id": f"{name}-{tag}",
                    "namespace": ns,
                    "text": t,
                    "vector": v,
                    "importance": 0.5,
                    "created_at": 10.0,
                    "last_used": 10.0,
                    "strength": s,
                }
            )
        return va

    t = _text(rng)
    add("near-below", t, _edit(t, rng), 0.85)  # admitted: centroid cos 0.962
    t = _text(rng)
    add("near-far", t, _edit(t, rng), 0.5)  # centroid cos 0.866 < 0.9: apart
    add("unrelated", _text(rng), _text(rng), 0.85)  # texts differ: never proposed
    t = _text(rng)
    add("split", t, _edit(t, rng), 0.85, ns_b="elsewhere")  # other namespace
    t = _text(rng)
    add("number", t + " since version seven", _edit(t, rng) + " since version eight", 0.85)
    t = _text(rng)
    add("heavy", t, _edit(t, rng), 0.85, strengths=(1.0, 19.0))  # light member at 0.864
    add("short", "likes green tea in the garden", "likes green tea in a garden", 0.85)
    t = _text(rng)
    va = add("crowded", t, _edit(t, rng), 0.85)
    # a short memory that is an engine pair of crowded-a: the MinHash pair is not isolated
    e = rng.normal(size=d)
    e -= (e @ va) * va
    e /= np.linalg.norm(e)
    v3 = 0.95 * va + np.sqrt(1 - 0.95**2) * e
    rows.append(
        {
            "id": "crowded-c",
            "namespace": "crowded",
            "text": "owns a copper kettle",
            "vector": v3,
            "importance": 0.5,
            "created_at": 10.0,
            "last_used": 10.0,
        }
    )
    return make_records(rows)


def test_texts_planted_as_near_exact_are_near_exact():
    rng = np.random.default_rng(1)
    t = _text(rng)
    i, j, jac = minhash_pairs(
        [t, _edit(t, rng), _text(rng)],
        np.zeros(3, np.int64),
        num_perm=MINHASH_PERM,
        fn_weight=MINHASH_FN_WEIGHT,
    )
    assert list(zip(i, j, strict=True)) == [(0, 1)] and 0.85 <= jac[0] < 1


def _run(recs, **kw):
    cfg = PassConfig(threshold=0.9, decay=False, cap=None, **kw)
    return run_pass(recs, cfg=cfg, sim_cfg=SimilarityConfig(device="cpu"), wall_h=20.0)


def _merged(res):
    m = res.records.meta
    return sorted(
        sorted(g)
        for _, g in m[m["merged_into"].map(lambda x: isinstance(x, str))]
        .groupby("merged_into")["id"]
        .apply(list)
        .items()
    )


def test_minhash_proposes_and_the_cluster_stage_decides():
    recs = _store()
    res = _run(recs)
    s = res.stats
    assert s.pairs == 1  # the similarity join: only crowded-a ~ crowded-c (0.95)
    # long units: every planted long text (2 per pair x 6 pairs, plus "crowded" a and b)
    assert s.minhash_units == 14
    # candidates: near-below, near-far, number, heavy, crowded ("split" spans namespaces)
    assert s.minhash_pairs == 5
    # admitted below the threshold: near-below (centroid 0.962) and number (conflict later)
    assert s.minhash_added == 2
    assert _merged(res) == [["crowded-a", "crowded-c"], ["near-below-a", "near-below-b"]]
    reasons = [e for e in res.events if e["op"] == "review"]
    assert [sorted(e["ids"]) for e in reasons] == [["number-a", "number-b"]]
    assert s.time_s["minhash"] >= 0


def test_minhash_off_and_without_the_join():
    recs = _store()
    off = _run(recs, minhash_min_chars=None)
    assert off.stats.minhash_pairs is None and "minhash_pairs" not in off.stats.as_dict()
    assert _merged(off) == [["crowded-a", "crowded-c"]]
    # near_dedup off: MinHash candidates alone; crowded-a ~ crowded-b is isolated now
    only = _run(recs, near_dedup=False)
    assert only.stats.pairs == 0 and only.stats.minhash_added == 3
    assert _merged(only) == [["crowded-a", "crowded-b"], ["near-below-a", "near-below-b"]]
    # a long-text bar above every text: nothing is long
    none = _run(recs, minhash_min_chars=100_000)
    assert none.stats.minhash_units == 0 and _merged(none) == _merged(off)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_minhash_settings(bad):
    recs = _store()
    with pytest.raises(ValueError, match="minhash_min_chars"):
        _run(recs, minhash_min_chars=bad)
    with pytest.raises(ValueError, match="minhash_threshold"):
        _run(recs, minhash_threshold=0.0)


def test_an_oversized_bucket_is_skipped_and_counted(monkeypatch):
    import consolidate.pipeline.long_texts as lt

    rng = np.random.default_rng(3)
    t = _text(rng)
    d = 64
    v = rng.normal(size=(6, d))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    rows = [
        {
            "id": f"x{k}",
            "namespace": "u",
            "text": t,
            "vector": v[k],
            "importance": 0.5,
            "created_at": 10.0,
            "last_used": 10.0,
        }
        for k in range(5)
    ]
    rows.append(
        {
            "id": "y",
            "namespace": "u",
            "text": _edit(t, rng),
            "vector": v[5],
            "importance": 0.5,
            "created_at": 10.0,
            "last_used": 10.0,
        }
    )
    recs = make_records(rows)
    monkeypatch.setattr(lt, "MINHASH_MAX_BUCKET", 3)
    res = _run(recs, exact_dedup=False)  # six near-identical texts share most buckets
    assert res.stats.minhash_skipped_buckets > 0
    # what the smaller buckets still propose is all that is proposed; nothing raised
    full = _run(recs, exact_dedup=False, minhash_min_chars=None)
    assert res.stats.minhash_pairs < 15 and full.stats.minhash_pairs is None
