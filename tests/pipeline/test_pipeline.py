"""The staged pass: stage functions against hand-computed values and float64 references, and
the LOCOMO main-job pass against the snapshot of the pass it replaced."""

import hashlib
import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from consolidate.config import ImportanceConfig, PassConfig, SimilarityConfig
from consolidate.ops.fidelity import lost_members
from consolidate.ops.merge import lost_facts
from consolidate.pipeline import PassStats, run_pass
from consolidate.pipeline.exact import exact_stage, hash_codes
from consolidate.pipeline.run import _start
from consolidate.pipeline.state import arrow_strings, id_ranks, segment_centroids
from tests.helpers import LOCOMO, make_records, random_rows


def test_segment_centroids_match_a_float64_reference():
    g = np.random.default_rng(1)
    v = g.normal(size=(40, 16)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    rows = g.permutation(40)[:25]
    sizes = [1, 3, 1, 5, 2, 1, 4, 1, 7]
    seg = np.repeat(np.arange(len(sizes)), sizes)
    w = g.uniform(1, 5, size=25)
    got = segment_centroids(torch.from_numpy(v), rows, seg, len(sizes), w, chunk=4).numpy()
    for s in range(len(sizes)):
        r, ws = rows[seg == s], w[seg == s]
        ref = (ws[:, None] * v[r].astype(np.float64)).sum(0)
        ref /= np.linalg.norm(ref)
        np.testing.assert_allclose(got[s], ref, atol=1e-7)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    # the block size (whole segments per block) never changes a bit of the result
    for chunk in (None, 1, 9, 1 << 16):
        other = segment_centroids(torch.from_numpy(v), rows, seg, len(sizes), w, chunk=chunk)
        assert np.array_equal(other.numpy(), got)


def test_id_ranks_follow_code_point_order():
    ids = np.array(["b", "a", "é", "B", "ab", "z9"], dtype=object)
    assert [ids[k] for k in np.argsort(id_ranks(ids))] == sorted(ids.tolist())


def test_arrow_strings_copy_what_arrow_can_hold():
    values = np.array(["ab c", "é ü", None, "x" * 70_000], dtype=object)
    arr = arrow_strings(values)
    assert arr is not None and arr.type == pa.large_string()
    got = arr.to_pylist()
    assert got == values.tolist()
    assert all(g is not v for g, v in zip(got, values, strict=True) if v is not None)  # new
    assert arrow_strings(["ok", "\ud800"]) is None  # a lone surrogate has no UTF-8
    assert arrow_strings(["ok", 3]) is None  # not a string


def test_id_ranks_by_byte_keys_equal_pythons_sort():
    # a long shared prefix, prefixes of one another, ties in the 8 bytes after the prefix
    # (resolved by the whole text), NUL (ties with the zero pad), multi-byte characters,
    # the empty id; then random ids that never tie, and too many ties (Arrow's sort)
    import pyarrow as pa

    from consolidate.pipeline.state import _byte_key_order

    rng = np.random.default_rng(3)
    odd = ["user-42/mem-" + s for s in ("", "a", "a\x00", "a\x00b", "ab", "abcdefgh", "abcdefghZ")]
    odd += ["user-42/mem-abcdefgh" + s for s in ("a", "", "é", "\U0001f600", "~")]
    odd += ["user-42/mem-" + "".join(rng.choice(list("xyz\x00é"), 9)) for _ in range(300)]
    cases = [
        sorted(set(odd), key=lambda _: rng.random()),
        [f"id-{k:016x}" for k in dict.fromkeys(rng.integers(0, 2**40, 500).tolist())],
        [f"{k % 7}" * 9 + str(k) for k in rng.permutation(400)],
    ]
    for ids in cases:
        arr = np.array(ids, dtype=object)
        assert [arr[k] for k in np.argsort(id_ranks(arr))] == sorted(ids)
    assert _byte_key_order(pa.array(cases[2])) is None  # ties everywhere: Arrow's sort
    assert len(_byte_key_order(pa.array(cases[1]))) == len(cases[1])


def test_id_ranks_of_ids_in_order_and_out_of_order():
    ids = np.array([f"m-{k:05d}" for k in range(50)], dtype=object)
    assert id_ranks(ids).tolist() == list(range(50))  # already sorted: no sort
    swapped = ids.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    want = list(range(50))
    want[10], want[11] = 11, 10
    assert id_ranks(swapped).tolist() == want


@pytest.mark.parametrize("high", [3, 1000, 2**40])
def test_key_order_is_lexsorts_order(high):
    from consolidate.pipeline.state import key_order

    g = np.random.default_rng(high)
    a, b, c = (g.integers(0, high, 5000) for _ in range(3))  # ties at high=3; 2**40: lexsort
    assert np.array_equal(key_order(a, b, c), np.lexsort((c, b, a)))
    assert np.array_equal(key_order(a - high // 2, c), np.lexsort((c, a - high // 2)))
    assert key_order(np.zeros(0, np.int64)).tolist() == []


def test_the_pass_leaves_the_callers_table_as_it_was():
    recs = make_records(random_rows(300, 16, namespaces=3, dup_frac=0.4))
    recs.meta.loc[5, "deleted_at"] = 1.0
    before, vec = recs.meta.copy(deep=True), recs.vectors.copy()
    res = run_pass(recs, cfg=PassConfig(threshold=0.9, cap=50), version=2, wall_h=2000.0)
    assert res.stats.merges > 0 and res.stats.dropped_cap > 0
    pd.testing.assert_frame_equal(recs.meta, before)
    assert np.array_equal(recs.vectors, vec)


def _rows():
    base = {"importance": 0.5, "created_at": 10.0, "last_used": 10.0}
    return [
        {
            **base,
            "id": "c",
            "namespace": "u",
            "text": "Likes tea.",
            "vector": [1, 0, 0],
            "strength": 2.0,
        },
        {
            **base,
            "id": "a",
            "namespace": "u",
            "text": "likes tea",
            "vector": [0, 1, 0],
            "strength": 1.0,
        },
        {**base, "id": "b", "namespace": "v", "text": "likes tea", "vector": [0, 0, 1]},
        {**base, "id": "d", "namespace": "u", "text": "likes coffee", "vector": [1, 1, 0]},
        {
            **base,
            "id": "e",
            "namespace": "u",
            "text": "likes tea",
            "vector": [0, 1, 1],
            "pinned": True,
        },
    ]


def test_exact_stage_groups_by_namespace_and_hash():
    recs = make_records(_rows())
    st = _start(recs, SimilarityConfig(device="cpu"), 100.0, "extractive", 2)
    st.now = np.full(len(recs), 100.0)
    st = exact_stage(st, PassConfig())
    u = st.units
    ids = recs.meta["id"].to_numpy(object)
    # units by (namespace, lowest id): u: {a, c} (same hash), d; v: b. e is pinned: no unit
    assert [ids[u.members(k)].tolist() for k in range(len(u))] == [["a", "c"], ["d"], ["b"]]
    assert st.stats.exact_groups == 1 and st.stats.exact_duplicates == 1
    assert u.weight.tolist() == [3.0, 1.0, 1.0]
    # the group's vector: (1 * e2 + 2 * e1) / 2 (weights over their max), renormalised
    np.testing.assert_allclose(u.vec[0].numpy(), np.array([2, 1, 0]) / math.sqrt(5), atol=1e-7)
    np.testing.assert_allclose(u.vec[1].numpy(), np.array([1, 1, 0]) / math.sqrt(2), atol=1e-7)


def test_nonempty_lists_are_read_once_then_for_new_rows_until_forgotten():
    rows = _rows()
    rows[1]["keep_apart"] = ["a"]
    rows[3]["derived_from"] = ["a", "b"]
    st = _start(make_records(rows), SimilarityConfig(device="cpu"), 100.0, "extractive", 2)
    assert st.nonempty("keep_apart").tolist() == [False, True, False, False, False]
    assert st.nonempty("derived_from").tolist() == [False, False, False, True, False]
    # rows the pass writes: only they are read (an earlier row's list is not read again)
    meta = st.meta.iloc[[3, 1]].reset_index(drop=True)
    meta["id"] = ["n1", "n2"]
    st.meta.at[3, "derived_from"] = []  # unseen until forgotten
    st.append(meta, torch.zeros((2, 3)))
    assert st.nonempty("derived_from").tolist() == [False, False, False, True, False, True, False]
    assert st.nonempty("keep_apart").tolist() == [False, True, False, False, False, False, True]
    st.forget("derived_from")
    assert st.nonempty("derived_from").tolist() == [False] * 5 + [True, False]


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two code arrays put the same positions together."""
    pairs = set(zip(a.tolist(), b.tolist(), strict=True))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_hash_codes_partition_values_as_factorize_does():
    from consolidate.text import text_hashes

    rng = np.random.default_rng(3)
    texts = [f"fact {k}" for k in rng.integers(0, 400, 2_000)]
    hashes = np.array(text_hashes(texts), dtype=object)
    codes = hash_codes(hashes)
    assert codes.dtype == np.int64
    want = pd.factorize(hashes)[0]
    assert _same_partition(codes, want) and len(set(codes.tolist())) == len(set(texts))
    # upper-case digits read as the same numbers
    assert _same_partition(hash_codes(np.array([h.upper() for h in hashes], object)), want)
    assert hash_codes(np.array([], object)).tolist() == []


def test_hash_codes_compare_whole_values_when_their_first_16_digits_tie():
    # one 64-bit key for two different values: the codes must still tell them apart
    tie = np.array(["0123456789abcdef" + x for x in ("aa", "bb", "aa", "", "bb")], object)
    assert hash_codes(tie).tolist() == [0, 1, 0, 2, 1]  # pd.factorize's codes
    # not hexadecimal, too short, not ASCII, not strings: pd.factorize's codes
    for odd in (
        ["zz", "yy", "zz"],
        ["0123", "0123", "4567"],
        ["0123456789abcdefé", "0123456789abcdefè", "0123456789abcdefé"],
        [12, 13, 12],
    ):
        v = np.array(odd, object)
        assert hash_codes(v).tolist() == pd.factorize(v)[0].tolist()


def test_pass_stats_read_like_the_summary_dict():
    s = PassStats(merger="extractive", merges=3, time_s={"merge": 0.5})
    assert s["merges"] == 3 and s["time_s"] is s.time_s
    assert "reflections" not in s and "score_min" in s
    with pytest.raises(KeyError):
        s["reflections"]
    s.reflections = 0
    assert s.as_dict()["reflections"] == 0
    json.dumps(s.as_dict())


def test_merged_vectors_are_member_centroids_and_rows_keep_their_positions():
    rows = random_rows(600, 24, seed=4, namespaces=5, dup_frac=0.3, noise=0.02)
    for k, r in enumerate(rows):
        r["strength"] = float(1 + k % 3)
    recs = make_records(rows)
    res = run_pass(
        recs,
        cfg=PassConfig(threshold=0.9, decay=False, cap=None),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=3,
        wall_h=2000.0,
    )
    assert res.stats.merges > 10
    m = res.records.meta
    n = len(recs)
    # the snapshot's rows first, in order; merged rows after them
    assert m["id"].tolist()[:n] == recs.meta["id"].tolist()
    np.testing.assert_array_equal(res.records.vectors[:n], recs.vectors)
    strength = recs.meta.set_index("id")["strength"]
    vec = dict(zip(recs.meta["id"], recs.vectors, strict=True))
    for k in range(n, len(m)):
        mid = m["id"].iat[k]
        members = m["id"][m["merged_into"] == mid].tolist()
        assert len(members) >= 2
        w = strength[members].to_numpy()
        ref = ((w / w.max())[:, None] * np.stack([vec[x] for x in members]).astype(np.float64)).sum(
            0
        )
        np.testing.assert_allclose(res.records.vectors[k], ref / np.linalg.norm(ref), atol=1e-7)
        assert m["strength"].iat[k] == min(w.sum(), 20.0)


# the pass this package had before the stages (commit 5244916) on the same input, version 7,
# wall clock 500,000 h: the sha256 of every row's fields (vectors apart, checked above), with
# the text and text hash of the 29 merged records left out: the sentence-deduplicating merger
# writes other texts for them than that pass's (which appended every member's sentences)
LOCOMO_SNAPSHOT = "b3454834927859926f0d7ea1162bd7ef7dad0770875a8569c3d4da12d2ff99a2"
_COLS = [
    "id",
    "namespace",
    "text",
    "importance",
    "created_at",
    "last_used",
    "strength",
    "pinned",
    "source_ids",
    "valid_from",
    "valid_to",
    "deleted_reason",
    "merged_into",
    "text_hash",
    "last_pass",
    "keep_apart",
    "derived_from",
]


def snapshot_digest(meta: pd.DataFrame) -> str:
    """sha256 over every row's fields except the vector and the wall-clock deletion time."""
    h = hashlib.sha256()
    for row in zip(
        *[meta[c].tolist() for c in _COLS], meta["deleted_at"].isna().tolist(), strict=True
    ):
        vals = []
        for v in row:
            if v is None or (isinstance(v, float) and math.isnan(v)):
                v = None
            elif isinstance(v, (list, tuple, np.ndarray)):
                v = [str(x) for x in v]
            elif isinstance(v, float):
                v = repr(v)
            vals.append(v)
        h.update(json.dumps(vals).encode())
    return h.hexdigest()


@pytest.mark.slow
def test_locomo_main_pass_gives_the_same_snapshot():
    if not LOCOMO.exists():
        pytest.skip(f"LOCOMO not found at {LOCOMO}")
    from consolidate.embed import Embedder
    from consolidate.store.locomo import locomo_records

    recs, _ = locomo_records(LOCOMO, Embedder(show_progress=False), ImportanceConfig(), None)
    # the retention policy 5244916 had as its default (tau 30 days), for the comparison
    res = run_pass(
        recs,
        cfg=PassConfig(tau_hours=720.0),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=7,
        wall_h=500000.0,
    )
    s = res.stats
    assert (s.records_in, s.pairs, s.clusters, s.merges, s.merged_members) == (2541, 42, 29, 29, 61)
    assert (s.dropped_floor, s.dropped_cap, s.records_out) == (464, 0, 2045)
    m = res.records.meta.copy()
    merged = m["id"].isin(set(m["merged_into"].dropna()))
    m.loc[merged, ["text", "text_hash"]] = ""
    assert snapshot_digest(m) == LOCOMO_SNAPSHOT
    # every merge keeps every member's content (the fidelity checker: 0 members lost); the
    # clause-deduplicating merger's texts are 1.79x their longest member's on average here
    texts = dict(zip(res.records.meta["id"], res.records.meta["text"], strict=True))
    merges = [e for e in res.events if e["op"] == "merge"]
    assert len(merges) == 29 and s.merges_losing_facts == 0 and s.members_lost == 0
    ratios = []
    for e in merges:
        members = [texts[x] for x in e["members"]]
        assert lost_facts(e["text"], members) == [], e
        assert lost_members(e["text"], [(x, (texts[x],)) for x in e["members"]]) == {}, e
        ratios.append(len(e["text"]) / max(len(t) for t in members))
        assert e["length_ratio"] == pytest.approx(ratios[-1], abs=1e-4)
    assert np.mean(ratios) == pytest.approx(
        1.7943, abs=1e-3
    ) and s.merge_text_ratio_mean == pytest.approx(np.mean(ratios))


def test_ranks_of_appended_ids_equal_a_full_sort():
    from consolidate.pipeline.state import _merge_ranks

    g = np.random.default_rng(2)
    old = np.array([f"r{k:04d}" for k in g.permutation(300)], dtype=object)
    new = np.array([f"m-{k:x}" for k in g.integers(0, 1 << 40, 25)] + ["r0100x", "a"], dtype=object)
    ids = np.r_[old, new]
    assert _merge_ranks(id_ranks(old), ids, len(old)).tolist() == id_ranks(ids).tolist()


def test_group_sums_add_in_numpys_order():
    from consolidate.pipeline.state import group_sums

    g = np.random.default_rng(7)
    sizes = g.integers(1, 40, 300)
    v = g.uniform(1, 30, int(sizes.sum())).round(1)  # non-integer strengths
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    ref = [v[s : s + k].sum() for s, k in zip(starts, sizes, strict=True)]
    assert group_sums(v, sizes).tolist() == ref  # bit for bit, not approximately


def test_invalid_utf8_ids_are_a_clear_error():
    rows = [
        {"id": "a", "namespace": "u", "text": "x", "vector": [1.0, 0.0]},
        {"id": "b", "namespace": "u", "text": "y", "vector": [0.0, 1.0]},
    ]
    recs = make_records(rows)
    recs.meta.loc[1, "id"] = "b\ud800"
    with pytest.raises(ValueError, match="valid UTF-8"):
        run_pass(recs, cfg=PassConfig(), sim_cfg=SimilarityConfig(device="cpu"))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_pass_pauses_the_garbage_collector_and_huge_pages_and_restores_them(enabled):
    """The stages run with the cyclic collector off and NumPy's huge-page advice off;
    afterwards both are as they were, also when a stage raises."""
    import gc

    from consolidate.ops.merge import ExtractiveMerger
    from consolidate.pipeline.run import _numpy_hugepage

    def hugepage() -> bool:
        now = _numpy_hugepage(True)
        _numpy_hugepage(now)
        return now

    seen = []

    class Watching(ExtractiveMerger):
        def merge_batch(self, requests):
            seen.append((gc.isenabled(), hugepage()))
            return super().merge_batch(requests)

    class Failing(ExtractiveMerger):
        def merge_batch(self, requests):
            raise RuntimeError("merger down")

    recs = make_records(random_rows(200, 16, seed=2, namespaces=2, dup_frac=0.3, noise=0.02))
    cfg = PassConfig(threshold=0.9, decay=False, cap=None)
    was, was_huge = gc.isenabled(), hugepage()
    try:
        gc.enable() if enabled else gc.disable()
        _numpy_hugepage(enabled)
        assert hugepage() is enabled
        res = run_pass(recs, cfg=cfg, sim_cfg=SimilarityConfig(device="cpu"), merger=Watching())
        assert res.stats.merges > 0 and seen == [(False, False)]
        assert gc.isenabled() is enabled and hugepage() is enabled
        with pytest.raises(RuntimeError, match="merger down"):
            run_pass(recs, cfg=cfg, sim_cfg=SimilarityConfig(device="cpu"), merger=Failing())
        assert gc.isenabled() is enabled and hugepage() is enabled
    finally:
        gc.enable() if was else gc.disable()
        _numpy_hugepage(was_huge)


def test_merges_are_asked_in_chunks_and_a_short_answer_is_an_error(monkeypatch):
    # 5 clusters in chunks of 2 (a model merger) or 3 (a model-free one): merge_batch calls
    # of 2, 2 and 1 or of 3 and 2 requests, each chunk answered before the next is asked; a
    # merger that answers one too few is refused
    import consolidate.pipeline.merging as mg
    from consolidate.ops.merge import ExtractiveMerger

    rows = random_rows(40, 16, seed=4, dup_frac=0.5, noise=0.01)
    recs = make_records(rows)
    cfg = PassConfig(threshold=0.9, now="1000")
    whole = run_pass(recs, cfg=cfg, wall_h=1001.0)  # one merge_batch call
    monkeypatch.setattr(mg, "MERGE_CHUNK", 2)
    monkeypatch.setattr(mg, "PURE_MERGE_CHUNK", 3)

    class Counting(ExtractiveMerger):
        pure = False  # as if it called a model

        def __init__(self, drop=False):
            super().__init__()
            self.sizes, self.drop = [], drop

        def merge_batch(self, requests):
            self.sizes.append(len(requests))
            out = super().merge_batch(requests)
            return out[:-1] if self.drop else out

    m = Counting()
    res = run_pass(recs, cfg=cfg, merger=m, wall_h=1001.0)
    n = res.stats.clusters
    assert n >= 3 and m.sizes == [2] * (n // 2) + [1] * (n % 2)
    assert res.records.meta.equals(whole.records.meta)
    assert res.events == whole.events
    Counting.pure = True
    m = Counting()
    res = run_pass(recs, cfg=cfg, merger=m, wall_h=1001.0)
    assert m.sizes == [3] * (n // 3) + [n % 3] * (n % 3 > 0)
    assert res.records.meta.equals(whole.records.meta)
    assert res.events == whole.events
    Counting.pure = False
    with pytest.raises(ValueError, match="returned 1 responses for 2 requests"):
        run_pass(recs, cfg=cfg, merger=Counting(drop=True), wall_h=1001.0)


@pytest.mark.parametrize("block,threaded_from", [(3, 1 << 16), (1024, 1 << 16), (3, 4)])
def test_unit_rows_rescale_only_rows_off_unit_length(monkeypatch, block, threaded_from):
    # unit rows (float64-normalised, then float32) are left as they are, with no copy; rows
    # rounded through fp16 (off by ~1e-3) are rescaled in float64; zero and NaN rows stay;
    # the same with the rows shared out over threads (threaded_from=4: 3 runs of rows)
    import consolidate.pipeline.run as run_mod

    monkeypatch.setattr(run_mod, "UNIT_BLOCK", block)
    monkeypatch.setattr(run_mod, "UNIT_THREADED_MIN", threaded_from)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((10, 24))
    unit = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    assert run_mod._unit_rows(unit) is unit
    v = unit.copy()
    v[[1, 7]] = v[[1, 7]].astype(np.float16).astype(np.float32) * 1.01
    v[4], v[8] = 0.0, np.nan
    got = run_mod._unit_rows(v)
    assert got is not v and np.array_equal(
        v[[1, 7]], (unit[[1, 7]].astype(np.float16).astype(np.float32) * 1.01)
    )
    want = v[[1, 7]].astype(np.float64)
    want = (want / np.linalg.norm(want, axis=1, keepdims=True)).astype(np.float32)
    assert np.array_equal(got[[1, 7]], want)
    same = [0, 2, 3, 4, 5, 6, 9]
    assert np.array_equal(got[same], v[same]) and np.isnan(got[8]).all()


def test_longest_text_of_each_cluster():
    from consolidate.pipeline.merging import _longest_texts

    texts = np.array(["ab", "abcd", "é", "", "xyz"], dtype=object)
    groups = [np.array([0, 1]), np.array([], np.int64), np.array([2, 3]), np.array([4, 0])]
    assert _longest_texts(texts, groups).tolist() == [4, 0, 1, 3]
    assert _longest_texts(texts, []).tolist() == []


def test_members_of_a_run_of_groups_read_their_rows_fields():
    import dataclasses

    from consolidate.ops.merge import MergeMember
    from consolidate.pipeline.merging import _MEMBER_FIELDS, member_columns, members_of

    # the columns' order is the dataclass's (members_of builds members from it by position)
    assert tuple(f.name for f in dataclasses.fields(MergeMember)) == _MEMBER_FIELDS
    rows = [
        {"id": f"r{k}", "text": f"t{k}", "vector": np.eye(4)[k % 4], "importance": k / 10}
        for k in range(6)
    ]
    rows[4]["source_ids"] = ["s1", "s0"]
    st = _start(make_records(rows), SimilarityConfig(device="cpu"), 0.0, "x", 1)
    groups = [np.array([5, 0]), np.array([3]), np.array([4, 1, 2])]
    cols = member_columns(st, groups)
    got = members_of(cols, [0, 2, 3, 6], 1, 3)
    assert [[m.id for m in g] for g in got] == [["r3"], ["r4", "r1", "r2"]]
    m = got[1][0]
    assert (m.text, m.importance, m.source_ids, m.sources) == ("t4", 0.4, ("s1", "s0"), ())
    assert members_of(cols, [0, 2, 3, 6]) == [
        tuple(
            MergeMember(**{f: c[k] for f, c in zip(_MEMBER_FIELDS, cols, strict=True)}) for k in ks
        )
        for ks in ([0, 1], [2], [3, 4, 5])
    ]


def test_a_pass_writes_valid_to_as_float64_whatever_the_input_column_held():
    from consolidate.store.schema import Records

    v = np.ones(8, np.float32)
    rows = [
        {"id": f"r{k}", "namespace": "a", "text": t, "vector": v + 0.01 * k, "last_used": 900.0}
        for k, t in enumerate(["Ann likes tea", "Ann likes tea; Ann walks"])
    ]
    recs = make_records(rows)
    meta = recs.meta.copy()
    meta["valid_to"] = pd.Series([None, None], dtype=object)
    res = run_pass(
        Records(meta, recs.vectors), cfg=PassConfig(threshold=0.9, now="1000"), wall_h=1003.0
    )
    assert res.stats.merges == 1 and res.stats.superseded == 0
    assert res.records.meta["valid_to"].dtype == np.float64
    assert res.records.meta["valid_to"].isna().all()


def test_the_merge_stage_reports_the_merger_s_calls_tokens_and_latency_percentiles():
    from consolidate.ops.merge import MergeResponse

    class Timed:
        """A model-like merger: the first member's text, one call, 10 + k prompt tokens and
        k seconds for the k-th request it answers."""

        name, handles_conflicts = "timed", False

        def __init__(self) -> None:
            self.k = 0

        def merge_batch(self, requests):
            out = []
            for r in requests:
                self.k += 1
                out.append(
                    MergeResponse(
                        r.members[0].text,
                        calls=1,
                        prompt_tokens=10 + self.k,
                        completion_tokens=2,
                        extra={"latency_s": float(self.k)},
                    )
                )
            return out

    rows = [
        {
            "id": f"r{c}{k}",
            "namespace": "a",
            "text": f"Ann likes tea {c}" + " daily" * k,
            "vector": np.eye(8)[c] + 0.01 * k * np.eye(8)[(c + 1) % 8],
        }
        for c in range(4)
        for k in range(2)
    ]
    cfg = PassConfig(threshold=0.9, now="1000", fidelity="report")
    st = run_pass(make_records(rows), cfg=cfg, merger=Timed(), wall_h=1003.0).stats
    assert st.clusters == 4 and st.model_calls == 4
    assert (st.prompt_tokens, st.completion_tokens) == (11 + 12 + 13 + 14, 8)
    # numpy's linear percentiles of 1, 2, 3, 4
    assert st.merge_latency_p50_s == pytest.approx(2.5)
    assert st.merge_latency_p95_s == pytest.approx(3.85)
