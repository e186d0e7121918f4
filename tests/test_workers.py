"""Forked workers for the pass's text rules: the same answers as inline, in order, and a
failed or dead worker is a clear error."""

import faulthandler
import multiprocessing
import os
import time

import numpy as np
import pandas as pd
import pytest

import consolidate.pipeline.merging as merging
import consolidate.pipeline.near as near
import consolidate.workers as workers_mod
from consolidate.config import PassConfig
from consolidate.ops.guard import conflict_reason, conflict_signature
from consolidate.ops.merge import ExtractiveMerger
from consolidate.pipeline import run_pass
from consolidate.pipeline.state import merged_id
from consolidate.text import text_hashes
from consolidate.workers import (
    FirstTouch,
    WorkerError,
    fork_map,
    resolve_workers,
    split_evenly,
    work_parts,
)
from tests.helpers import make_records

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")


def test_split_evenly_covers_the_range_in_near_equal_parts():
    assert split_evenly(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert split_evenly(2, 4) == [(0, 1), (1, 2)]
    assert split_evenly(0, 2) == []
    assert work_parts(1) == 1 and work_parts(2) == 2 * workers_mod.PARTS_PER_WORKER


def _until(flag, value, what):
    """Wait (at most 60 s) until the shared ``flag`` reaches ``value``."""
    deadline = time.monotonic() + 60
    while flag.value < value:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_fork_map_answers_in_order_from_forked_processes():
    parent = os.getpid()
    done = multiprocessing.get_context("fork").Value("q", 0)

    def fn(k):
        if os.getpid() == parent:
            # the first part is this process's; the children take every other part
            # meanwhile (this one waits for them), and this process finds none left
            _until(done, 4, "the children's parts")
        else:
            with done.get_lock():
                done.value += 1
        return k * k, os.getpid() != parent

    got = fork_map(fn, list(range(5)), 3)
    assert [a for a, _ in got] == [0, 1, 4, 9, 16]
    assert [forked for _, forked in got] == [False, True, True, True, True]


def test_fork_map_hands_the_parts_left_to_whichever_process_is_free():
    # a child held up on its first part: this process answers every other part, in order;
    # with the parts split in advance it would wait for the child's half instead
    parent = os.getpid()
    ctx = multiprocessing.get_context("fork")
    held, answered = ctx.Value("q", 0), ctx.Value("q", 0)

    def fn(k):
        if os.getpid() != parent:
            held.value = 1
            _until(answered, 11, "this process's parts")
        else:
            if k == 0:
                _until(held, 1, "the child's first part")
            with answered.get_lock():
                answered.value += 1
        return k + 100, os.getpid()

    got = fork_map(fn, list(range(12)), 2)
    assert [a for a, _ in got] == list(range(100, 112))
    by_child = [k for k, (_, pid) in enumerate(got) if pid != parent]
    assert len(by_child) == 1 and by_child[0] >= 1  # the child answered only its first part
    assert sum(pid == parent for _, pid in got) == 11


def test_the_dispenser_hands_out_every_part_once_in_order():
    for n, step in ((2, 1), (5, 1), (1025, 1), (1026, 2), (3000, 3)):
        left = workers_mod._Dispenser(n)
        try:
            assert left.step == step
            assert list(left.taken()) == list(range(1, n))
            assert list(left.taken()) == []  # empty: nothing is handed out twice
        finally:
            left.close()
    parts = list(range(3000))  # runs of 3 parts per token
    assert fork_map(lambda k: k * 2, parts, 2) == [k * 2 for k in parts]


def test_fork_map_with_one_worker_runs_inline():
    seen = []
    assert fork_map(lambda k: seen.append(k) or k + 1, [1, 2, 3], 1) == [2, 3, 4]
    assert seen == [1, 2, 3]  # the calls' side effects are this process's


def test_a_failing_or_dead_worker_is_a_clear_error():
    parent = os.getpid()
    ctx = multiprocessing.get_context("fork")

    def fail(k):
        if os.getpid() == parent:
            _until(started, 1, "the child")  # leaves part 1 to the child
        elif k == 1:
            started.value = 1
            raise KeyError("record r7")
        return k

    started = ctx.Value("q", 0)
    with pytest.raises(
        WorkerError, match=r"text worker 1 of 2 failed on part 1:(.|\n)*KeyError: 'record r7'"
    ):
        fork_map(fail, [0, 1], 2)

    def die(k):
        if os.getpid() == parent:
            _until(started, 1, "the child")
            return 0
        started.value = 1
        os._exit(3)

    started = ctx.Value("q", 0)
    with pytest.raises(
        WorkerError, match=r"text worker 1 of 2 died without an answer \(exit code 3\)"
    ):
        fork_map(die, [0, 1], 2)
    # a part that fails in this process raises its own error
    with pytest.raises(KeyError, match="r8"):
        fork_map(lambda k: {}["r8"] if os.getpid() == parent else k, [0, 1], 2)


class _NoLoad(Exception):
    """Pickles, but does not load: its ``__init__`` wants two arguments."""

    def __init__(self, a, b):
        super().__init__(a)


def test_answers_that_do_not_pickle_or_load_and_parts_that_fork_again():
    import threading

    # an answer a child cannot pickle, or that this process cannot load: a WorkerError
    # that says so (the same call inline answers)
    lock = _second_part_forked(lambda k: threading.Lock() if k else None)
    with pytest.raises(
        WorkerError, match=r"text worker 1 of 2 failed on its answers to parts \[1\]"
    ) as e:
        fork_map(lock, [0, 1], 2)
    assert "cannot pickle" in str(e.value)
    with pytest.raises(WorkerError, match=r"text worker 1 of 2 sent answers that do not load"):
        fork_map(_second_part_forked(lambda k: _NoLoad(k, 0)), [0, 1], 2)
    # a part may fork_map in turn, in a child too
    inner = _second_part_forked(lambda k: fork_map(lambda q: q + 1, [10 * k, 10 * k + 1], 2))
    assert fork_map(inner, [0, 1], 2) == [[1, 2], [11, 12]]
    # parts given as an iterator are read once, as inline
    assert fork_map(str, (k for k in range(3)), 2) == ["0", "1", "2"]


def test_children_that_ignore_sigterm_are_stopped_when_this_process_fails():
    import signal

    parent = os.getpid()
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the children inherit it
    try:
        started = multiprocessing.get_context("fork").Value("q", 0)

        def fn(k):
            if os.getpid() == parent:
                _until(started, 1, "the child")
                raise KeyError("r9")
            started.value = 1
            time.sleep(30)  # stopped by the parent's cleanup, not waited for
            return k

        t = time.monotonic()
        with pytest.raises(KeyError, match="r9"):
            fork_map(fn, [0, 1, 2], 2)
        assert time.monotonic() - t < 20
    finally:
        signal.signal(signal.SIGTERM, old)
    assert not multiprocessing.active_children()


def test_arrays_not_shared_are_left_out_of_the_children_and_back_after():
    a = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: whole pages of its own
    mid = len(a) // 2
    # a child that reads an array kept out of it faults: a clear error, not a wrong answer
    with pytest.raises(WorkerError, match=r"died without an answer \(exit code -11\)"):
        fork_map(
            _second_part_forked(lambda k: (faulthandler.disable(), float(a[mid]))[1]),
            [0, 1],
            2,
            not_shared=[a],
        )
    # the parent read it meanwhile, and children see it again afterwards
    assert fork_map(_second_part_forked(lambda k: float(a[mid]) + k), [0, 1], 2) == [
        mid,
        mid + 1.0,
    ]


def _second_part_forked(fn):
    """``fn`` for ``fork_map(..., [0, 1], 2)`` such that the child answers part 1: this
    process's part 0 waits until the child has started on it."""
    parent, started = os.getpid(), multiprocessing.get_context("fork").Value("q", 0)

    def g(k):
        if os.getpid() == parent:
            _until(started, 1, "the child")
        else:
            started.value = 1
        return fn(k)

    return g


def test_resolve_workers():
    assert resolve_workers(3) == 3 and resolve_workers(1) == 1
    assert resolve_workers(None) >= 1
    with pytest.raises(ValueError, match="text workers must be an integer >= 1"):
        resolve_workers(0)


def test_namespace_parts_cut_between_namespaces():
    ns = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3], np.int64)
    assert near.namespace_parts(ns, 1) == [(0, 10)]
    # even cuts move forward to the next namespace's start: 5 is one already; of 3 and 7,
    # 3 is one and 7 (inside namespace 2) moves to 9
    assert near.namespace_parts(ns, 2) == [(0, 5), (5, 10)]
    assert near.namespace_parts(ns, 3) == [(0, 3), (3, 9), (9, 10)]
    assert near.namespace_parts(np.zeros(6, np.int64), 4) == [(0, 6)]
    assert near.namespace_parts(np.zeros(0, np.int64), 2) == []


TEXTS = [
    "Gina has 2 cats",
    "Gina has 3 cats",
    "Gina has 2 cats",
    "Gina does not like tea",
    "Gina likes tea",
    "Jon likes tea",
    "Jon has two dogs",
    "Jon has 2 dogs",
]


def _answers(got, m):
    """guard_pairs' (cls, keys, reasons) as (cls, {(low, high): reason}); keys ascending."""
    cls, keys, reasons = got
    assert keys.tolist() == sorted(keys.tolist()) and len(keys) == len(reasons)
    return cls, {(k // m, k % m): r for k, r in zip(keys.tolist(), reasons.tolist(), strict=True)}


def test_guard_pairs_equal_the_guard_pair_by_pair():
    # items 0-4 in one namespace, 5-7 in another; every pair within a namespace
    ns = np.array([0, 0, 0, 0, 0, 1, 1, 1], np.int64)
    pairs = [(a, b) for a in range(8) for b in range(a + 1, 8) if ns[a] == ns[b]]
    ci = np.array([b for a, b in pairs], np.int64)  # both orientations in the input
    cj = np.array([a for a, b in pairs], np.int64)
    for workers in (1, 2):
        parts = near.namespace_parts(ns, workers)
        assert len(parts) == workers
        cls, answers = _answers(near.guard_pairs(TEXTS, ci, cj, parts, workers), 8)
        assert answers == {(a, b): conflict_reason(TEXTS[a], TEXTS[b]) for a, b in pairs}
        assert answers[(0, 1)] == "number" and answers[(3, 4)] == "negation"
        assert answers[(0, 2)] is None
        # a class is the part's first item with an equal signature
        assert cls.tolist() == [0, 1, 0, 3, 4, 5, 6, 7]
        sig = [conflict_signature(t) for t in TEXTS]
        assert all((cls[a] == cls[b]) == (sig[a] == sig[b]) for a, b in pairs)
    with pytest.raises(ValueError, match="crosses two parts"):
        near.guard_pairs(TEXTS, ci, cj, [(0, 3), (3, 8)], 1)


def test_guard_pairs_in_groups_keep_classes_inside_a_group():
    # item 5 repeats item 0's text in the other namespace: one part, two groups
    texts = TEXTS[:5] + ["Gina has 2 cats"] + TEXTS[6:]
    ns = np.array([0, 0, 0, 0, 0, 1, 1, 1], np.int64)
    pairs = [(a, b) for a in range(8) for b in range(a + 1, 8) if ns[a] == ns[b]]
    ci = np.array([a for a, _ in pairs], np.int64)
    cj = np.array([b for _, b in pairs], np.int64)
    want = {(a, b): conflict_reason(texts[a], texts[b]) for a, b in pairs}
    for workers in (1, 2):
        parts = near.namespace_parts(ns, workers)
        cls, answers = _answers(near.guard_pairs(texts, ci, cj, parts, workers, groups=ns), 8)
        assert answers == want
        # a class is the first item of its group with an equal signature
        assert cls.tolist() == [0, 1, 0, 3, 4, 5, 6, 7]
    # without groups, one part: item 5 shares item 0's class
    cls, answers = _answers(near.guard_pairs(texts, ci, cj, [(0, 8)], 1), 8)
    assert answers == want and cls.tolist() == [0, 1, 0, 3, 4, 0, 6, 7]
    with pytest.raises(ValueError, match="crosses two groups"):
        near.guard_pairs(texts, np.array([0]), np.array([5]), [(0, 8)], 1, groups=ns)


NAMES = ["Gina", "Jon", "Ana", "Omar", "Lena", "Ravi", "Mia", "Tom", "Sara", "Ivan", "Zoe"]
THINGS = ["tea", "jazz", "chess", "tennis", "poetry", "sushi", "hiking"]


def _store(seed: int):
    """150 clusters of 1-4 near-duplicates in 6 namespaces, whose texts conflict (numbers,
    negations), repeat (exact duplicates) or add clauses; some pinned, some tombstones, and
    in every tenth cluster the first two members kept apart as an undo leaves them."""
    g = np.random.default_rng(seed)
    rows = []
    for c in range(150):
        base = g.normal(size=24)
        name, thing = NAMES[c % len(NAMES)], THINGS[c % len(THINGS)]
        first = len(rows)
        for _ in range(int(g.integers(1, 5))):
            k = len(rows)
            rows.append(
                {
                    "id": f"r{k:04d}",
                    "namespace": f"ns{c % 6}",
                    "text": [
                        f"{name} has {int(g.integers(2, 4))} cats",
                        f"{name} does not like {thing}",
                        f"{name} likes {thing}",
                        f"{name} likes {thing}; {name} walks daily",
                        f"{name} likes {thing}. {name} reads at night",
                    ][int(g.integers(5))],
                    "vector": (base + 0.03 * g.normal(size=24)).astype(np.float32),
                    "importance": float(g.uniform(0.2, 1.0)),
                    "created_at": 500.0 + float(g.uniform(0, 400)),
                    "last_used": 900.0 + float(g.uniform(0, 90)),
                    "pinned": bool(g.random() < 0.05),
                }
            )
            if g.random() < 0.03:
                rows[-1]["deleted_at"] = 995.0
        if c % 10 == 0 and len(rows) - first >= 2:
            rows[first]["keep_apart"] = [rows[first + 1]["id"]]
            rows[first + 1]["keep_apart"] = [rows[first]["id"]]
    return make_records(rows)


def _inline_and_forked(recs):
    """The default pass over ``recs`` inline and with two forked text workers."""
    return [
        run_pass(
            recs,
            cfg=PassConfig(
                threshold=0.9, now="1000", cap=None, max_drop_fraction=1.0, text_workers=workers
            ),
            version=2,
            wall_h=1003.0,
        )
        for workers in (1, 2)
    ]


@pytest.mark.parametrize("newer_wins", [False, True])
def test_the_pass_gives_the_same_records_with_forked_workers(monkeypatch, newer_wins):
    calls = []
    for mod in (near, merging):
        real = mod.fork_map

        def spy(fn, parts, workers, not_shared=(), real=real):
            # the pass keeps its vectors (the snapshot's, the units') out of the children
            calls.append((len(parts), workers, sum(a.nbytes for a in not_shared)))
            return real(fn, parts, workers, not_shared)

        monkeypatch.setattr(mod, "fork_map", spy)
    recs = _store(5)
    cfg = PassConfig(threshold=0.9, now="1000", cap=None, max_drop_fraction=1.0)
    monkeypatch.setattr(near, "PARALLEL_MIN_PAIRS", 0)
    monkeypatch.setattr(merging, "PARALLEL_MIN_CLUSTERS", 0)
    out = {}
    for workers in (1, 2, 3):
        calls.clear()
        res = run_pass(
            recs,
            cfg=PassConfig(**{**cfg.__dict__, "text_workers": workers}),
            merger=ExtractiveMerger(newer_wins=newer_wins),
            version=2,
            wall_h=1003.0,
        )
        vec_bytes = recs.vectors.nbytes
        # the guard's parts hold whole namespaces (6 here), the merges' are equal runs
        (guard, w1), (merges, w2) = (c[:2] for c in calls)
        assert w1 == w2 == workers and merges == work_parts(workers)
        assert guard == min(work_parts(workers), 6)
        assert all(c[2] >= vec_bytes for c in calls)
        out[workers] = res
    s = out[1].stats
    assert s.merges >= 40 and s.review_pairs >= 60 and s.exact_merges >= 20
    assert s.superseded >= 5 if newer_wins else s.superseded == 0
    assert s.tombstones_in >= 5
    assert any(e["op"] == "review" and e["reason"] == "undone merge" for e in out[1].events)
    for workers in (1, 2, 3):
        # every text_hash is its text's, those of merged texts from the workers included
        meta = out[workers].records.meta
        assert meta["text_hash"].tolist() == text_hashes(meta["text"].tolist())
    for workers in (2, 3):
        assert out[workers].records.meta.equals(out[1].records.meta)
        assert np.array_equal(out[workers].records.vectors, out[1].records.vectors)
        assert out[workers].events == out[1].events


def test_texts_arrow_cannot_hold_give_the_same_pass_with_forked_workers(monkeypatch):
    # a lone surrogate (a text that is no valid UTF-8) cannot go into the Arrow copies the
    # workers read: the pass reads those texts as they are and gives the same records
    recs = _store(7)
    texts = recs.meta["text"].to_numpy(object).copy()
    texts[::7] = [t + " \udcff" for t in texts[::7]]
    recs.meta["text"] = pd.Series(texts, dtype=object)
    monkeypatch.setattr(near, "PARALLEL_MIN_PAIRS", 0)
    monkeypatch.setattr(merging, "PARALLEL_MIN_CLUSTERS", 0)
    out = _inline_and_forked(recs)
    assert out[0].stats.merges >= 20
    assert any("\udcff" in t for t in out[0].records.meta["text"].dropna())
    assert out[1].records.meta.equals(out[0].records.meta)
    assert out[1].events == out[0].events


@pytest.mark.parametrize("newer_wins", [False, True])
def test_a_merged_record_takes_the_id_of_the_members_it_merges(newer_wins):
    # the id is the hash of the merged members: the cluster's own when all are merged, the
    # rest's when the merger superseded some (not the id its request carried)
    res = run_pass(
        _store(5),
        cfg=PassConfig(threshold=0.9, now="1000", cap=None, max_drop_fraction=1.0),
        merger=ExtractiveMerger(newer_wins=newer_wins),
        version=2,
        wall_h=1003.0,
    )
    made = [e for e in res.events if e["op"] in ("merge", "exact_merge")]
    assert len(made) >= 60
    assert all(e["id"] == merged_id(2, e["members"]) for e in made)
    sup = [e for e in made if e.get("superseded")]
    assert len(sup) == (2 if newer_wins else 0)
    for e in sup:
        assert e["id"] != merged_id(2, e["members"] + e["superseded"])
        assert e["id"] in set(res.records.meta["id"])


def test_a_cluster_too_big_for_pairwise_similarities_gets_the_same_merge_in_workers(monkeypatch):
    # a cluster of more than PAIRWISE_SIMILARITIES_MAX members lists each member's cosine to
    # its centroid, read from the vectors before the fork (a worker reads no vector)
    g = np.random.default_rng(3)
    base = g.normal(size=24)
    words = ["tea", "jazz", "chess", "tennis", "poetry", "sushi", "hiking", "opera", "golf"]
    words += ["kites", "maps", "clocks", "jade", "figs", "yoga", "salsa", "surf", "ramen"]
    words += ["stamps", "coins", "shells", "comics", "vinyl", "posters", "dolls", "mugs"]
    rows = [
        {
            "id": f"k{k:02d}",
            "namespace": "big",
            "text": f"Kim collects {w}",
            "vector": (base + 0.01 * g.normal(size=24)).astype(np.float32),
            "importance": 0.5,
            "created_at": 500.0 + k,
            "last_used": 900.0,
        }
        for k, w in enumerate(words)
    ]
    recs = make_records(rows)
    monkeypatch.setattr(merging, "PARALLEL_MIN_CLUSTERS", 0)
    out = _inline_and_forked(recs)
    made = max((e for e in out[0].events if e["op"] == "merge"), key=lambda e: len(e["members"]))
    assert len(made["members"]) == 25 > merging.PAIRWISE_SIMILARITIES_MAX
    sims = made["similarities"]
    assert [s[:2] for s in sims] == [[i, "centroid"] for i in made["members"]]
    at = [int(i[1:]) for i in made["members"]]
    v = recs.vectors[at].astype(np.float64)
    cen = v.sum(0) / np.linalg.norm(v.sum(0))
    np.testing.assert_allclose([s[2] for s in sims], v @ cen, atol=1e-6)
    assert out[1].events == out[0].events
    assert out[1].records.meta.equals(out[0].records.meta)


def test_first_touch_zeroes_a_prefix_in_whole_steps_and_nothing_else(monkeypatch):
    import time

    monkeypatch.setattr(workers_mod, "FIRST_TOUCH_STEP", 4096)
    a = np.full(40_000, 7, np.uint8)
    ft = FirstTouch(a, 30_001, populate=False)  # 8 steps, the last of 1,329 bytes
    deadline = time.monotonic() + 30
    while not ft.done and time.monotonic() < deadline:
        time.sleep(0.001)
    ft.join()
    ft.join()  # idempotent
    assert not a[:30_001].any()
    assert (a[30_001:] == 7).all()

    # stopped at once: whatever was zeroed is whole steps from the start, the rest as it was
    b = np.full(1 << 20, 5, np.int64)
    ft = FirstTouch(b, b.nbytes, populate=False)
    ft.join()
    assert ft.done
    zeroed = int(np.argmax(b != 0)) if (b != 0).any() else len(b)
    assert (zeroed * 8) % 4096 == 0
    assert not b[:zeroed].any() and (b[zeroed:] == 5).all()


def test_first_touch_populate_maps_pages_in_and_writes_nothing():
    import mmap

    ft0 = FirstTouch(np.zeros(1 << 16, np.uint8), 1 << 16)
    ft0.join()
    if ft0.writes:
        with pytest.raises(OSError):
            FirstTouch(np.zeros(1 << 16, np.uint8), 1 << 16, populate=True)
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    # the caller writes the array while the thread maps its pages in: nothing is lost
    a = np.empty(8 << 20, np.float32)
    ft = FirstTouch(a, a.nbytes, populate=True)
    assert not ft.writes
    a[:] = np.arange(len(a), dtype=np.float32)
    ft.join()
    ft.join()  # idempotent
    assert ft.done
    assert np.array_equal(a, np.arange(len(a), dtype=np.float32))
    # data already there survives a populate of its pages, a partial page at either end too
    b = np.arange(3 * mmap.PAGESIZE + 100, dtype=np.uint8)
    want = b.copy()
    ft = FirstTouch(b[1:], b.nbytes - 1)
    ft.join()
    assert np.array_equal(b, want)
    # a range without a whole page: nothing to map in, and no error when asked for populate
    for nbytes in (0, 100):
        tiny = np.full(100, 3, np.uint8)
        ft = FirstTouch(tiny, nbytes, populate=True)
        ft.join()
        assert not ft.writes and (tiny == 3).all()
    # zero mode still on request
    c = np.full(4096 * 4, 9, np.uint8)
    ft = FirstTouch(c, c.nbytes, populate=False)
    assert ft.writes
    ft.join()
    assert ft.done


def test_first_touch_refuses_what_it_cannot_map_in():
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        FirstTouch(a[:, :2], 8)
    with pytest.raises(ValueError, match="65 bytes of an array of 64"):
        FirstTouch(a, 65)
    with pytest.raises(ValueError, match="-1 bytes"):
        FirstTouch(a, -1)
    frozen = np.frombuffer(b"not to be written", np.uint8)
    with pytest.raises(ValueError, match="writeable"):
        FirstTouch(frozen, frozen.nbytes)
    assert bytes(frozen) == b"not to be written"


def test_a_pass_that_fails_after_starting_its_buffer_thread_stops_it(monkeypatch):
    import consolidate.pipeline.run as run_mod

    started = []
    real = run_mod.FirstTouch

    def spy(array, nbytes):
        started.append(real(array, nbytes))
        return started[-1]

    def fail(st, cfg):
        raise RuntimeError("purge failed")

    monkeypatch.setattr(run_mod, "FirstTouch", spy)
    monkeypatch.setattr(run_mod, "FIRST_TOUCH_MIN_BYTES", 0)
    monkeypatch.setattr(workers_mod, "FIRST_TOUCH_STEP", 64)  # thousands of steps to go
    monkeypatch.setattr(run_mod, "purge_stage", fail)
    with pytest.raises(RuntimeError, match="purge failed"):
        run_pass(_store(5), cfg=PassConfig(threshold=0.9, now="1000"), version=2, wall_h=1003.0)
    assert len(started) == 1 and started[0].done


@pytest.mark.parametrize("step", [64, 1 << 25])
def test_the_pass_maps_its_vector_buffer_in_ahead_with_the_same_records(monkeypatch, step):
    import consolidate.pipeline.run as run_mod

    started = []
    real = run_mod.FirstTouch

    def spy(array, nbytes):
        started.append(nbytes)
        return real(array, nbytes)

    monkeypatch.setattr(run_mod, "FirstTouch", spy)
    monkeypatch.setattr(workers_mod, "FIRST_TOUCH_STEP", step)
    recs = _store(5)
    cfg = PassConfig(threshold=0.9, now="1000", cap=None, max_drop_fraction=1.0, text_workers=2)
    out = {}
    for least in (1 << 60, 0):
        monkeypatch.setattr(run_mod, "FIRST_TOUCH_MIN_BYTES", least)
        out[least] = run_pass(recs, cfg=cfg, version=2, wall_h=1003.0)
    live = int(np.isnan(recs.meta["deleted_at"].to_numpy(np.float64)).sum())
    assert started == [live * recs.vectors.shape[1] * 4]
    assert out[0].stats.merges >= 40
    assert out[0].records.meta.equals(out[1 << 60].records.meta)
    assert np.array_equal(out[0].records.vectors, out[1 << 60].records.vectors)
    assert out[0].events == out[1 << 60].events
