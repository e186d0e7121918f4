"""Fleet runs on Ray Data (a real local Ray cluster, 2 CPUs): the records committed equal a
single-process pass's, shards hold whole namespaces, deltas are applied once, the safety
stops hold across shards."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from consolidate.config import PassConfig, RunnerConfig, SimilarityConfig
from consolidate.pipeline import run_pass
from consolidate.pipeline.retention import MassDropError
from consolidate.store import InvalidRecordsError
from consolidate.store.lance import LanceStore
from tests.helpers import REPO, require_smollm2

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from consolidate.fleet import plan_shards, run_fleet_pass  # noqa: E402

WALL = 480_000.0  # hours since the epoch (Oct 2024), the same for both runs
SIM = SimilarityConfig(device="cpu")


def _pass_bench():
    from consolidate.bench import pass_bench

    return pass_bench


def fleet_records(n=3000, ns_size=100, seed=3, stale_every=9):
    """``n / ns_size`` namespaces with planted exact and near duplicates; every
    ``stale_every``-th row last used two years before ``WALL`` (the floor drops it)."""
    recs, _ = _pass_bench().make_pass_store(n, ns_size, d=32, seed=seed, now_h=WALL - 1.0)
    lu = recs.meta["last_used"].to_numpy().copy()
    lu[::stale_every] = WALL - 2 * 365 * 24
    recs.meta["last_used"] = lu
    recs.meta["created_at"] = np.minimum(recs.meta["created_at"].to_numpy(), lu)
    return recs


@pytest.fixture(autouse=True)
def upsert_always(monkeypatch):
    """The single-process commit upserts too (a fleet commit never rewrites the table), so
    both stores number their versions alike: merged ids mix in the version."""
    import consolidate.store.lance.writing as ls

    monkeypatch.setattr(ls, "REWRITE_FRACTION", 1.01)


@pytest.fixture(scope="module")
def cluster():
    # one logical GPU: Ray schedules GPU actors on it (torch finds no CUDA, so their
    # similarity runs on the CPU), which runs the GPU actors' path here
    ray.init(
        num_cpus=2,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


def twin_stores(tmp_path, recs):
    a = LanceStore(tmp_path / "single")
    a.create(recs)
    ids = recs.meta["id"].tolist()
    a.mark_used(ids[:4], now=WALL - 2.0)  # touches in several namespaces
    a.mark_used([ids[7], ids[len(ids) // 2]], now=WALL - 3.0)
    shutil.copytree(a.root, tmp_path / "fleet")
    return a, LanceStore(tmp_path / "fleet")


def single(store, pc, namespaces=None, wall=WALL):
    with store.lock():
        snap = store.load(namespaces=namespaces)
        res = run_pass(snap.records, cfg=pc, sim_cfg=SIM, version=snap.version + 1, wall_h=wall)
        info = store.commit(res.records, res.events, base=snap, pass_time_h=wall)
    return res, info


def fleet(store, pc, namespaces=None, wall=WALL, **runner):
    rc = RunnerConfig(kind="ray", **{"actors": 2, "max_rows_per_shard": 700, **runner})
    with store.lock():
        return run_fleet_pass(
            store, namespaces=namespaces, pass_cfg=pc, sim_cfg=SIM, runner=rc, wall_h=wall
        )


def same_store(a, b):
    ra, rb = a.load().records, b.load().records
    ia = np.argsort(ra.meta["id"].to_numpy(str))
    ib = np.argsort(rb.meta["id"].to_numpy(str))
    ma = ra.meta.iloc[ia].reset_index(drop=True)
    mb = rb.meta.iloc[ib].reset_index(drop=True)
    diff = [c for c in ma.columns if not ma[c].equals(mb[c])]
    assert not diff, {
        c: ma[c][ma[c] != mb[c]].head(3).tolist() + mb[c][ma[c] != mb[c]].head(3).tolist()
        for c in diff
    }
    np.testing.assert_array_equal(ra.vectors[ia], rb.vectors[ib])
    return ma


def events(store, name):
    """The changelog's events, sorted; an event listing ``ids`` (a purge: one per shard in a
    fleet run) counts once per id."""
    out = []
    for line in (store.root / "changelogs" / name).read_text().splitlines():
        e = json.loads(line)
        for i in e.pop("ids") if "ids" in e else [None]:
            out.append(json.dumps({**e, "id": i} if i else e, sort_keys=True))
    return sorted(out)


@pytest.mark.slow
def test_fleet_run_commits_what_a_single_process_pass_commits(tmp_path, cluster):
    recs = fleet_records()
    a, b = twin_stores(tmp_path, recs)
    pc = PassConfig(force=True, max_drop_fraction=0.5)
    res, info = single(a, pc)
    out = fleet(b, pc)
    meta = same_store(a, b)
    assert events(a, info["changelog"]) == events(b, out["commit"]["changelog"])
    st, fs = res.stats.as_dict(), out["stats"].as_dict()
    for k in (
        "records_in",
        "exact_duplicates",
        "pairs",
        "clusters",
        "merges",
        "merged_members",
        "dropped_floor",
        "records_out",
    ):
        assert st[k] == fs[k], k
    assert fs["merges"] > 0 and fs["exact_merges"] > 0 and fs["dropped_floor"] > 0
    # 30 namespaces of 100 rows (plus touches), at most 700 rows a shard: 5 shards of 7
    # namespaces and one of 2, except that the touch naming two namespaces' ids binds them
    assert out["fleet"]["shards"] == 5
    # distinct actor processes that ran a shard: at most runner.actors; on a loaded machine
    # Ray can hand every shard to the first actor before the second has started
    assert out["fleet"]["workers"] in (1, 2)
    assert out["fleet"]["rows"] == 3000 and out["records_read"] == 3000
    assert not list((b.root / "deltas").glob("*.json"))  # every delta folded, once
    # a second round: new rows, touches and a pass over tombstones (purge) in both
    new = fleet_records(n=600, ns_size=100, seed=9)
    new.meta["id"] = [f"new-{i}" for i in range(600)]
    new.meta["namespace"] = meta["namespace"].drop_duplicates().iloc[:6].tolist() * 100
    for s in (a, b):
        s.append(new)
        s.mark_used(["new-1", "new-2"], now=WALL - 1.5)
    pc2 = PassConfig(force=True, tombstone_retention_hours=1.0)
    res2, info2 = single(a, pc2, wall=WALL + 2)  # round 1's tombstones are 2 h old
    out2 = fleet(b, pc2, wall=WALL + 2)
    same_store(a, b)
    assert events(a, info2["changelog"]) == events(b, out2["commit"]["changelog"])
    assert out2["stats"].purged == res2.stats.purged > 0


@pytest.mark.slow
def test_incremental_fleet_run_equals_the_partial_single_process_pass(tmp_path, cluster):
    recs = fleet_records(n=1200)
    a, b = twin_stores(tmp_path, recs)
    ns = sorted(set(recs.meta["namespace"]))
    fired = ns[:3] + ns[7:9]
    # touches naming a namespace outside the run stay pending in both runs
    other = recs.meta["id"][recs.meta["namespace"] == ns[10]].iloc[0]
    inside = recs.meta["id"][recs.meta["namespace"] == ns[0]].iloc[5]
    for s in (a, b):
        s.mark_used([inside, other], now=WALL - 4.0)
    pc = PassConfig(force=True)
    single(a, pc, namespaces=fired)
    out = fleet(b, pc, namespaces=fired)
    same_store(a, b)
    assert out["records_read"] == 5 * 100
    assert out["fleet"]["deltas_left_pending"] == 2
    left = [sorted(s.delta_ids(p.name) for p in (s.root / "deltas").glob("*.json")) for s in (a, b)]
    assert left[0] == left[1] == sorted([[inside, other], recs.meta["id"].iloc[:4].tolist()])


def test_plan_packs_whole_namespaces_and_keeps_a_delta_in_one_shard(tmp_path):
    recs = fleet_records(n=1000)  # 10 namespaces of 100 rows
    s = LanceStore(tmp_path / "s")
    s.create(recs)
    ns = sorted(set(recs.meta["namespace"]))
    first = {n: recs.meta["id"][recs.meta["namespace"] == n].iloc[0] for n in ns}
    s.mark_used([first[ns[0]], first[ns[9]]], now=WALL)  # binds ns0 and ns9
    s.mark_used([first[ns[4]]], now=WALL)
    version, pending = s.pending()
    plan = plan_shards(s, version=version, pending=pending, namespaces=None, max_rows=250)
    # components in order of their first namespace: {0, 9} (200 rows), then 1..8 (100
    # each), packed while a shard stays within 250 rows
    assert plan.shards == [[ns[0], ns[9]], ns[1:3], ns[3:5], ns[5:7], ns[7:9]]
    assert plan.rows.tolist() == [200] * 5
    assert [len(d) for d in plan.deltas] == [1, 0, 1, 0, 0] and plan.left_pending == []
    big = plan_shards(s, version=version, pending=pending, namespaces=None, max_rows=150)
    assert big.shards[0] == [ns[0], ns[9]] and len(big.shards) == 9  # one over 150 rows
    part = plan_shards(s, version=version, pending=pending, namespaces=ns[:5], max_rows=10**6)
    assert part.shards == [ns[:5]] and part.deltas == [[pending[1]]]
    assert part.left_pending == [pending[0]]  # names ns9, outside the run
    with pytest.raises(ValueError, match="max_rows_per_shard"):
        plan_shards(s, version=version, pending=pending, namespaces=None, max_rows=0)


def test_a_read_task_loads_and_reads_its_shard_without_torch(tmp_path):
    """A read task as Ray ships it (cloudpickled) loads in a fresh process and reads its
    shard, packed or not, without importing torch: read tasks' workers stay small."""
    import subprocess
    import sys

    from consolidate.fleet import _datasource

    recs = fleet_records(n=300)
    s = LanceStore(tmp_path / "s")
    s.create(recs)
    version, pending = s.pending()
    plan = plan_shards(s, version=version, pending=pending, namespaces=None, max_rows=100)
    for packed in (False, True):
        task = _datasource(str(s.root), plan, 256, packed, [1]).get_read_tasks(1)[0]
        (tmp_path / "task.pkl").write_bytes(ray.cloudpickle.dumps(task.read_fn))
        code = (
            "import pickle, sys\n"
            "fn = pickle.loads(open(sys.argv[1], 'rb').read())\n"
            "(t,) = list(fn())\n"
            "print('torch' in sys.modules, t.num_rows, t.column('_shard').to_pylist()[:1])\n"
        )
        p = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "task.pkl")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        rows = 1 if packed else int(plan.rows[1])
        assert p.stdout.split() == ["False", str(rows), "[1]"]


@pytest.mark.slow
def test_store_wide_safety_stop_over_all_shards_commits_nothing(tmp_path, cluster):
    # every third row stale: a third of each namespace is dropped, under the per-namespace
    # stop (90%) but over a store-wide limit of 25%, which no single shard decides alone
    recs = fleet_records(n=1200, stale_every=3)
    s = LanceStore(tmp_path / "s")
    s.create(recs)
    before = s.head().version
    with pytest.raises(MassDropError, match="max_drop_fraction=0.25"):
        fleet(s, PassConfig(force=True, max_drop_fraction=0.25))
    assert s.head().version == before
    assert [p.name for p in (s.root / "changelogs").iterdir()] == ["changelog-000001.jsonl"]
    # the per-namespace stop fires inside a shard and reaches the caller as itself
    lu = recs.meta["last_used"].to_numpy().copy()
    ns = recs.meta["namespace"].to_numpy()
    lu[np.flatnonzero(ns == ns[0])[3:]] = WALL - 5 * 365 * 24  # 97 of its 100 rows
    recs.meta["last_used"] = lu
    recs.meta["created_at"] = np.minimum(recs.meta["created_at"].to_numpy(), lu)
    s2 = LanceStore(tmp_path / "s2")
    s2.create(recs)
    with pytest.raises(MassDropError, match="of 1 namespace"):
        # no importance protects here: the stop is under test, not the protected tier
        fleet(s2, PassConfig(force=True, max_drop_fraction=1.0, protect_importance=None))
    assert s2.head().version == before


@pytest.mark.slow
def test_consolidate_job_with_the_ray_runner(tmp_path, cluster, compose_cfg):

    from consolidate.jobs.consolidate import format_summary, run_consolidate

    recs = fleet_records(n=1000)
    a, b = twin_stores(tmp_path, recs)

    def job(store, runner, *more):
        cfg = compose_cfg(
            "consolidate",
            overrides=[
                f"store.dir={store.root}",
                "store.init_from=null",
                "similarity.device=cpu",
                f"runner={runner}",
                "runner.max_rows_per_shard=400",
                *more,
            ],
        )
        return run_consolidate(cfg, out_dir=str(tmp_path / runner))

    v0 = b.head().version
    s1, s2 = job(a, "local"), job(b, "ray", "runner.shards_per_commit=2")
    assert s2["fleet"]["shards"] == 3 and s2["ran"]
    assert s2["fleet"]["commits"] == [v0 + 1, v0 + 2]  # shards 1-2, then 3
    assert f"commits          2 versions ({v0 + 1}, {v0 + 2})" in format_summary(s2)
    assert s2["trigger"] == s1["trigger"]
    for k in ("records_in", "merges", "dropped_floor", "records_out"):
        assert s1["stats"][k] == s2["stats"][k], k
    assert "runner           ray: 3 shards" in format_summary(s2)
    # no policy.json: the summary and the console say the policy is uncalibrated
    assert s1["policy"] == s2["policy"] == {"calibrated": False}
    assert "tau 2160 h, floor 0.001, cap 1000: uncalibrated" in format_summary(s1)
    assert json.loads(Path(s2["summary_path"]).read_text())["fleet"]["shards"] == 3
    # the clocks differ between the two jobs (wall time), so compare what does not depend
    # on it: which records are live, and their texts
    la, lb = a.load().records, b.load().records
    live = lambda r: sorted(r.meta["text"][r.live_mask()])  # noqa: E731
    assert live(la) == live(lb)


@pytest.mark.slow
def test_deltas_that_reach_other_namespaces_or_no_stored_row(tmp_path, cluster):
    """A touch of a record merged (by a write-path update) into a record of another
    namespace lands on that record in both runs; a touch naming a purged id is folded by a
    fleet run over the whole store, as by a single-process pass."""
    recs = fleet_records(n=1000)
    a, b = twin_stores(tmp_path, recs)
    ns = sorted(set(recs.meta["namespace"]))
    x = recs.meta["id"][recs.meta["namespace"] == ns[0]].iloc[3]
    y = recs.meta["id"][recs.meta["namespace"] == ns[9]].iloc[3]
    a.patch([{"id": x, "op": "delete", "into": y, "at": WALL - 5.0}])
    a.mark_used([x], now=WALL - 1.0)
    # a recall of a record a pass purged meanwhile (as mark_used during a pass writes)
    (a.root / "deltas" / "0000000000000000001-1-abcd.touch.json").write_text(
        json.dumps({"ids": ["purged-meanwhile"], "now": WALL - 1.0})
    )
    for p in (a.root / "deltas").glob("*.json"):  # the same files: the same retired time
        shutil.copy(p, b.root / "deltas" / p.name)
    pc = PassConfig(force=True)
    single(a, pc)
    out = fleet(b, pc, max_rows_per_shard=100)  # ns0 and ns9 would sit in other shards
    meta = same_store(a, b).set_index("id")
    assert meta.loc[y, "last_used"] == WALL - 1.0
    assert out["fleet"]["deltas_left_pending"] == 0
    assert not list((b.root / "deltas").glob("*.json"))


@pytest.mark.slow
def test_an_invalid_stored_row_names_itself_or_goes_to_quarantine(tmp_path, cluster):
    import lance

    from consolidate.store.schema import records_to_arrow
    from tests.helpers import make_records

    recs = fleet_records(n=600)
    s = LanceStore(tmp_path / "s")
    s.create(recs)
    bad = make_records(
        [
            {
                "id": "BAD-ROW",
                "namespace": recs.meta["namespace"].iloc[0],
                "text": "importance out of range",
                "vector": [1.0] + [0.0] * 31,
                "importance": 2.0,
                "created_at": WALL - 5,
                "last_used": WALL - 5,
            }
        ]
    )
    lance.write_dataset(records_to_arrow(bad, "fp32"), str(s.dataset_path), mode="append")
    before = s.head().version
    with pytest.raises(InvalidRecordsError, match="importance.*'BAD-ROW'"):
        fleet(s, PassConfig(force=True))
    assert s.head().version == before
    q = LanceStore(s.root, quarantine=True)
    shutil.copytree(s.root, tmp_path / "single")
    single(LanceStore(tmp_path / "single", quarantine=True), PassConfig(force=True))
    fleet(q, PassConfig(force=True))
    assert len(list((q.root / "quarantine").glob("*.parquet"))) == 1
    assert "BAD-ROW" not in set(q.load().records.meta["id"])
    same_store(LanceStore(tmp_path / "single"), q)


def test_bad_runner_settings_fail_fast(tmp_path, cluster):
    s = LanceStore(tmp_path / "s")
    s.create(fleet_records(n=300))
    pc = PassConfig(force=True)
    for kw, match in [
        ({"gpus_per_actor": 2.0}, "exceeds the cluster's 1 GPUs"),
        ({"cpus_per_actor": 3.0}, "exceeds the cluster's 2 CPUs"),
        ({"actors": True}, "runner.actors"),
        ({"max_rows_per_shard": 0}, "max_rows_per_shard"),
        ({"llm": "vllm"}, "runner.llm must be actor or ray_data"),
        ({"llm": "ray_data"}, "needs an LLM merger"),
    ]:
        rc = RunnerConfig(kind="ray", **{"actors": 1, **kw})
        with s.lock(), pytest.raises(ValueError, match=match):
            run_fleet_pass(s, namespaces=None, pass_cfg=pc, sim_cfg=SIM, runner=rc)
    from consolidate.store import Store

    p = Store(tmp_path / "pq")
    p.create(fleet_records(n=300))
    with pytest.raises(TypeError, match="Parquet store"):
        run_fleet_pass(
            p, namespaces=None, pass_cfg=pc, sim_cfg=SIM, runner=RunnerConfig(kind="ray")
        )
    v = s.head().version
    out = fleet(s, pc, namespaces=[])
    assert out["commit"]["snapshot"] is None and s.head().version == v


def test_gpu_actors_get_whole_shards(tmp_path, cluster):
    """With gpus_per_actor, each shard travels as one packed row (Ray Data batches GPU
    actors by a fixed row count): the same records as the single-process pass."""
    recs = fleet_records(n=1200)
    a, b = twin_stores(tmp_path, recs)
    pc = PassConfig(force=True)
    single(a, pc)
    out = fleet(b, pc, actors=1, gpus_per_actor=1.0, cpus_per_actor=1.0)
    same_store(a, b)
    assert out["fleet"]["shards"] == 2 and out["records_read"] == 1200


@pytest.mark.slow
def test_llm_stage_answers_the_merges_of_every_shard_in_rounds(tmp_path, cluster):
    """runner.llm=ray_data: the actors' LLM merger asks the driver, which has one engine
    answer the requests of all shards (here SmolLM2 through the transformers backend, in
    place of Ray Data's vLLM processor, which tests/llm/test_vllm.py runs in .venv-vllm). The
    records are those of a single-process pass with the same merger and answers, which
    finds every answer in the response cache the fleet run filled."""
    require_smollm2()
    from consolidate.llm.merger import LLMMerger
    from consolidate.llm.transformers_backend import TransformersBackend

    recs = fleet_records(n=200)  # 2 namespaces of 100 rows: 2 shards
    a, b, c = (LanceStore(tmp_path / name) for name in ("single", "fleet", "again"))
    for s in (a, b, c):
        s.create(recs)
    models = str(REPO / ".cache" / "models")
    merge = {
        "_target_": "consolidate.llm.merger.LLMMerger",
        "backend": "transformers",
        "backend_kwargs": {"cache_dir": models},
        "max_tokens": 48,
        "cache_path": str(tmp_path / "llm_cache.sqlite"),
    }
    engine = TransformersBackend(cache_dir=models)
    pc = PassConfig(force=True)
    rc = RunnerConfig(kind="ray", actors=2, max_rows_per_shard=100, llm="ray_data")
    with b.lock():
        out = run_fleet_pass(
            b,
            namespaces=None,
            pass_cfg=pc,
            sim_cfg=SIM,
            runner=rc,
            merge=merge,
            wall_h=WALL,
            llm_backend=engine,
        )
    llm, fs = out["fleet"]["llm"], out["stats"]
    assert out["fleet"]["shards"] == 2 and fs.merger == "llm:transformers"
    assert fs.clusters > 0 and llm["cached"] == 0
    # one round of first answers, one of retries where any answer was rejected
    assert llm["rounds"] == 1 + (fs.model_calls > fs.clusters)
    assert llm["requests"] == fs.model_calls  # every request sent once
    merger = LLMMerger(
        backend="transformers",
        backend_kwargs={"cache_dir": models},
        cache_path=merge["cache_path"],
        max_tokens=48,
    )
    with a.lock():
        snap = a.load()
        res = run_pass(
            snap.records, cfg=pc, sim_cfg=SIM, merger=merger, version=snap.version + 1, wall_h=WALL
        )
        info = a.commit(res.records, res.events, base=snap, pass_time_h=WALL)
    assert merger.backend.misses == 0 and merger.backend.hits == fs.model_calls
    same_store(a, b)
    assert events(a, info["changelog"]) == events(b, out["commit"]["changelog"])
    assert res.stats.merges == fs.merges and res.stats.model_calls == fs.model_calls
    # a rerun asks the cache, not the engine
    with c.lock():
        again = run_fleet_pass(
            c,
            namespaces=None,
            pass_cfg=pc,
            sim_cfg=SIM,
            runner=rc,
            merge=merge,
            wall_h=WALL,
            llm_backend=_NoCalls(engine),
        )
    assert again["fleet"]["llm"]["cached"] == again["fleet"]["llm"]["requests"] == fs.model_calls
    same_store(b, c)


class _NoCalls:
    """The engine's name and model; any call fails the test."""

    def __init__(self, engine):
        self.name, self.model = engine.name, engine.model

    def chat(self, requests):
        raise AssertionError(f"{len(requests)} requests reached the engine")


@pytest.mark.slow
def test_commits_per_group_of_shards_keep_the_work_done_before_a_failure(tmp_path, cluster):
    """runner.shards_per_commit=2: a version for every two shards done, the same records
    as one commit; a shard that fails leaves its namespaces as they were, and every other
    shard is committed."""
    from consolidate.store.schema import records_to_arrow
    from tests.helpers import make_records

    recs = fleet_records(n=1200)  # 12 namespaces of 100 rows: 6 shards of 200
    a, b, c = (LanceStore(tmp_path / name) for name in ("single", "groups", "failing"))
    for s in (a, b, c):
        s.create(recs)
    pc = PassConfig(force=True, max_drop_fraction=0.5)
    single(a, pc)
    v0 = b.head().version
    out = fleet(b, pc, max_rows_per_shard=200, shards_per_commit=2)
    assert out["fleet"]["shards"] == 6 and out["fleet"]["commits"] == [v0 + 1, v0 + 2, v0 + 3]
    assert [v["op"] for v in b.versions()][-3:] == ["pass"] * 3
    assert out["commit"]["version"] == b.head().version == v0 + 3
    same_store(a, b)
    assert out["stats"].merges > 0 and out["stats"].dropped_floor > 0
    # one invalid stored row in the last namespace (101 rows now: a shard of its own): its
    # shard fails, the six others commit
    import lance

    ns = sorted(set(recs.meta["namespace"]))
    bad = make_records(
        [
            {
                "id": "BAD-ROW",
                "namespace": ns[-1],
                "text": "importance 2",
                "vector": [1.0] + [0.0] * 31,
                "importance": 2.0,
                "created_at": WALL - 5,
                "last_used": WALL - 5,
            }
        ]
    )
    lance.write_dataset(records_to_arrow(bad, "fp32"), str(c.dataset_path), mode="append")
    before = c.read_rows(c.head().version, ns[-1:]).sort_by("id")
    with pytest.raises(InvalidRecordsError, match="BAD-ROW"):
        fleet(c, pc, max_rows_per_shard=200, shards_per_commit=2, actors=1)
    got = c.read_rows(c.head().version, ns[:-1]).to_pandas()
    want = a.load().records.meta

    def rows(m, name):  # merged ids mix in the version, one later in c (the append)
        m = m[m["namespace"] == name]
        return sorted(
            zip(
                ["m-" if i.startswith("m-") else i for i in m["id"]],
                m["deleted_reason"].fillna(""),
                strict=True,
            )
        )

    for name in ns[:-1]:  # the shards done: as the single-process pass left them
        assert rows(got, name) == rows(want, name)
    assert c.read_rows(c.head().version, ns[-1:]).sort_by("id").equals(before)
    assert [v["op"] for v in c.versions()].count("pass") == 3


class _Joiner:
    """A stand-in LLM stage for the round protocol (no model): the merged text is the
    members' texts joined (it keeps every fact); ``reject`` answers a third of the first
    requests with no JSON (the merger asks again); ``fail_after`` raises on that call."""

    name, model = "joiner", "join"

    def __init__(self, reject=False, fail_after=None):
        self.reject, self.fail_after, self.calls = reject, fail_after, 0

    def chat(self, requests):
        import zlib

        from consolidate.llm.base import ChatResponse

        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("the engine is down")
        out = []
        for r in requests:
            user = r.messages[-1]["content"]
            notes = [json.loads(x[2:]) for x in user.split("\n") if x.startswith("- ")]
            bad = self.reject and self.calls == 1 and zlib.crc32(user.encode()) % 3 == 0
            out.append(
                ChatResponse("no json" if bad else json.dumps({"text": " ".join(notes)}), 1, 1, 0.0)
            )
        return out


@pytest.mark.slow
def test_a_failed_llm_stage_keeps_the_shards_done_before_it(tmp_path, cluster):
    """With commits per group, the shards done when the LLM stage fails are committed
    (a group not yet full included); nothing is lost and the error is the stage's."""
    s = LanceStore(tmp_path / "s")
    recs = fleet_records(n=600)
    s.create(recs)
    v0 = s.head().version
    merge = {
        "_target_": "consolidate.llm.merger.LLMMerger",
        "backend": "transformers",
        "cache_path": None,
        "max_tokens": 48,
    }
    rc = RunnerConfig(
        kind="ray", actors=2, max_rows_per_shard=100, llm="ray_data", shards_per_commit=4
    )
    with s.lock(), pytest.raises(RuntimeError, match="the engine is down"):
        run_fleet_pass(
            s,
            namespaces=None,
            pass_cfg=PassConfig(force=True),
            sim_cfg=SIM,
            runner=rc,
            merge=merge,
            wall_h=WALL,
            llm_backend=_Joiner(reject=True, fail_after=1),
        )
    assert s.head().version == v0 + 1  # the shards done: one group, not yet full
    ids = s.read_rows(s.head().version, columns=["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) and set(recs.meta["id"]) <= set(ids)
    with pytest.raises(ValueError, match="a mapping with _target_"), s.lock():
        run_fleet_pass(
            s,
            namespaces=None,
            pass_cfg=PassConfig(force=True),
            sim_cfg=SIM,
            runner=rc,
            merge="vllm",
        )
